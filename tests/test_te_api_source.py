"""The TE backend's per-version calls (nemo_fp8_align/backends/te_api.py's tables, which te.py
and te_watch.py call through) against each released Transformer Engine version's own Python
source, read with ``ast`` (TE needs CUDA to import): the Float8Tensor class load_te_api finds,
each build method and its keyword arguments, the method TE's own builds go through, the
transpose-cache attributes the backend reads and resets, the non-TN query and the
post-all-gather function, and the generation each version is given. ``make test`` unpacks the
wheels (``pip download --no-deps``, pure Python) into .te-wheels/<version>/ (TE_SOURCE_VERSIONS
in the Makefile); absent, the tests skip with the reason."""

import re
from pathlib import Path

import pytest

from nemo_fp8_align.backends.te_api import (BUILD_CALLS, BUILD_METHOD, FLOAT8_MODULES,
                                             FP8_ATTR_KEYS, FP8_ATTRS, GEN_1_6, GEN_1_8,
                                             GEN_2_10, NON_TN_QUERIES, POST_ALL_GATHER,
                                             api_generation, parse_te_version)
from support.te_source import TESource, accepts_keywords

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = re.search(r"^TE_SOURCE_VERSIONS \?= (.*)$", (ROOT / "Makefile").read_text(),
                     re.M).group(1).split()


@pytest.fixture(params=VERSIONS)
def te(request):
    root = ROOT / ".te-wheels" / request.param
    if not (root / "transformer_engine" / "pytorch").is_dir():
        pytest.skip(f"TE {request.param}'s source is not unpacked in {root} (make test does it: "
                    "the .te-wheels target)")
    return request.param, api_generation(parse_te_version(request.param)), TESource(root)


def _float8_classes(src):
    """What load_te_api imports: the first of FLOAT8_MODULES that has Float8Tensor, with its
    TE bases."""
    for module in FLOAT8_MODULES:
        found = src.find(module, "Float8Tensor")
        if found:
            return list(src.hierarchy(*found))
    raise AssertionError(f"no Float8Tensor in any of {FLOAT8_MODULES}")


def test_versions_cover_te_1x_and_each_2x_generation():
    gens = {api_generation(parse_te_version(v)) for v in VERSIONS}
    assert {"1.9.0.post1", "1.13.0", "2.20.2"} <= set(VERSIONS) and len(gens) == 3  # 1.8, 2.0, 2.10
    assert GEN_1_6 not in gens  # TE 1.6 / 1.7 are not on the registry: their row is not checked


def test_build_calls_exist_with_their_keywords(te):
    version, gen, src = te
    classes = _float8_classes(src)
    for name, kwargs in BUILD_CALLS[gen]:
        fn = src.method(classes, name)
        assert fn is not None, f"TE {version}: Float8Tensor has no {name}"
        assert accepts_keywords(fn, kwargs) == [], f"TE {version}: {name} takes no {list(kwargs)}"
    assert src.method(classes, BUILD_METHOD[gen]) is not None, (version, BUILD_METHOD[gen])


def test_transpose_cache_attributes_the_backend_reads_and_resets(te):
    version, gen, src = te
    classes = _float8_classes(src)
    assigned = src.self_attributes(classes)
    assert "_data" in assigned, version  # read by the kernel path and verify mode
    if gen in (GEN_1_6, GEN_1_8):
        # TE 1.x: the properties read FP8_ATTRS[key]; the backend reads and resets the keys.
        assert FP8_ATTRS in assigned, version
        props = src.class_properties(classes)
        for prop, key in FP8_ATTR_KEYS.items():
            assert key in props.get(prop, []), f"TE {version}: {prop} is not {FP8_ATTRS}[{key!r}]"
    else:
        assert set(FP8_ATTR_KEYS) <= assigned, (version, set(FP8_ATTR_KEYS) - assigned)


def test_non_tn_query_and_post_all_gather_where_the_generation_says(te):
    version, gen, src = te
    queries = [name for module, name in NON_TN_QUERIES if src.find(module, name)]
    if gen in (GEN_1_6, GEN_1_8):
        assert queries == [], f"TE {version} has {queries}: the backend assumes TN-only on 1.x"
    else:
        assert len(queries) == 1, (version, queries)
    post = src.find(*POST_ALL_GATHER)
    assert (post is not None) == (gen == GEN_2_10), (version, gen)
    if post is not None:
        assert len(post[0].args.args) == 1, version  # called with the chunk's list of weights
