"""What the plugin supports, in two tables every other module reads: the FP8 recipes (the
post-all-gather work of each, and where it can be aligned) and the megatron-core setups it refuses.

The runtime (:func:`~nemo_fp8_align.assemble.assemble`), the startup checker
(``config_check``) and the planner read these tables; nothing else writes a recipe fact or a
refusal.

The recipes
-----------

The post-all-gather work of each quantized-weight recipe, named by kind.

After a chunk's parameter all-gather, every FP8 / FP4 recipe megatron-core trains with leaves
work that each rank does at its own first use of the chunk unless it is placed (docs/design.md, section 5c):

=================  ===============================  ============================================
kind               recipe (TE tensor)               the work, and whose code does it
=================  ===============================  ============================================
transpose          delayed, tensorwise              byte transpose of the FP8 data (TE's
                   (``Float8Tensor``)               ``_create_transpose``; the plugin's backend)
columnwise         blockwise (``Float8Blockwise     the column-wise copy: byte transpose of the
                   QTensor``, 2D weight blocks)     data and of the block scales (TE's
                                                    ``_create_columnwise``)
requantize         mxfp8 with megatron-core's       the gathered BF16 re-quantized into the MXFP8
                   ``reuse_grad_buf_for_mxfp8_      parameter (megatron-core's
                   param_ag`` (``MXFP8Tensor``)     ``_post_param_sync``)
nvfp4-transpose    nvfp4 (``NVFP4Tensor``)          the NVFP4 2D transpose of the packed 4-bit
                                                    data and its scales (TE >= 2.14, batched)
=================  ===============================  ============================================

Only ``transpose`` is ever done by the plugin's own code; the others are done by TE's or
megatron-core's code, which the aligned finish calls at the aligned slot
(below: on which megatron-core versions).

Where each kind can be placed: the plugin never does a block-scaled recipe's work itself; its
aligned finish calls megatron-core's ``finish_param_sync`` at the aligned slot, and
megatron-core's post-processing there does the work. So a recipe can be aligned exactly
where megatron-core post-processes after the wait, *and* after every all-gather the plugin cannot
redo itself (the forced synchronous ones of evaluation and checkpointing). Read in megatron-core's
``distributed.param_and_grad_buffer`` module (0.12.3, 0.16.1, 0.17.1, 0.18.2, 0.19.2):

=================  ==========================================================================
kind               aligned on
=================  ==========================================================================
transpose          every version (the plugin's backend builds it where megatron-core does not)
columnwise         >= 0.16: ``finish_param_sync`` calls ``post_all_gather_processing`` after its
                   wait (TE's ``_create_columnwise``); after a forced all-gather on 0.16 / 0.17
                   the plugin's watch asks TE's ``post_all_gather_processing`` again
nvfp4-transpose    >= 0.17 (``fp4_param_gather``): ``finish_param_sync`` hands every
                   ``is_float8tensor`` parameter to it, TE 2's ``QuantizedTensor`` NVFP4
                   included (>= 0.18 names ``is_nvfp4tensor`` too); forced all-gathers on 0.17
                   as for columnwise
requantize         >= 0.18: ``_post_param_sync`` re-quantizes after every all-gather, forced ones
                   too; on 0.16 / 0.17 a forced all-gather leaves the MXFP8 params un-requantized
                   and only megatron-core's code could redo it
=================  ==========================================================================

Older megatron-core (no post-processing: TE builds the column-wise copy lazily at first use) and
NeMo's Apex path (the plugin would have to build it itself) are refused for the block-scaled
kinds: the plugin never byte-transposes block-scaled data. MXFP8 *without* the grad-buffer reuse
has no post-all-gather work at all (TE's ``post_all_gather_processing`` passes MXFP8 by): its
weights are left out, nothing to align.

The refused setups
------------------

Every megatron-core setup the plugin cannot align, in one table, read where megatron-core
keeps each setting.

``align_fp8_transposes`` refuses at attach, before anything is wrapped, when any row fires,
and names every row that fired at once. Each row says which megatron-core versions have its
setting; on the others the row reads nothing (``getattr`` with a default) and never fires.
``tests/test_refusals.py`` builds megatron-core's own config classes for every row on every
version in CI.

The startup check (``nemo-fp8-align check``) runs the same rows on NeMo's model config, which
NeMo passes through to ``TransformerConfig`` under the same names
(``config_check/rules/refused.py``), and so on Megatron-LM's flags: this table is the one place
a refusal is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from nemo_fp8_align.errors import UnsupportedSetupError

__all__ = ["TRANSPOSE", "COLUMNWISE", "REQUANTIZE", "NVFP4_TRANSPOSE", "KINDS", "TE_BLOCK_CLASSES",
           "RECIPE_KIND", "SINCE", "McoreFeatures", "chunk_kind", "kind_of", "kinds_of",
           "mcore_features", "recipe_refusals", "refuse_recipes", "weights_with_work",
           "REFUSALS", "Refusal", "Setup", "fired", "refuse_unsupported", "refuse_path"]

# ---------------------------------------------------------------------------------------------
# The recipes

TRANSPOSE = "transpose"
COLUMNWISE = "columnwise"
REQUANTIZE = "requantize"
NVFP4_TRANSPOSE = "nvfp4-transpose"
KINDS = (TRANSPOSE, COLUMNWISE, REQUANTIZE, NVFP4_TRANSPOSE)

#: TE's block-scaled tensor classes (attribute names of the TE API surface) and their kind.
TE_BLOCK_CLASSES = (("Float8BlockwiseQTensor", COLUMNWISE), ("NVFP4Tensor", NVFP4_TRANSPOSE),
                    ("MXFP8Tensor", REQUANTIZE))

#: megatron-core's ``fp8_recipe`` / ``fp4_recipe`` name -> the kind of its weights' work.
RECIPE_KIND = {"delayed": TRANSPOSE, "tensorwise": TRANSPOSE, "blockwise": COLUMNWISE,
               "mxfp8": REQUANTIZE, "nvfp4": NVFP4_TRANSPOSE}


def kind_of(backend: object, weight: object) -> str:
    """The kind of ``weight``'s post-all-gather work: the backend's ``kind_of`` where it has
    one, else ``transpose`` (a backend of per-tensor FP8 weights only)."""
    ask = getattr(backend, "kind_of", None)
    return ask(weight) if ask is not None else TRANSPOSE


def chunk_kind(kinds: Iterable[Optional[str]]) -> str:
    """A chunk's kinds in one telemetry value: one kind, or several joined with ``+`` (a chunk
    mixing recipes); ``transpose`` for a chunk without quantized weights (and old records)."""
    found = sorted({k for k in kinds if k})
    return "+".join(found) if found else TRANSPOSE


_OFF = "or do not attach the plugin (policy=off)"


class McoreFeatures:
    """What the installed megatron-core does after a parameter all-gather."""

    def __init__(self, post_processes: bool, post_param_sync: bool, version: str,
                 fp4_param_gather: bool = False) -> None:
        self.post_processes = post_processes  # >= 0.16: post_all_gather_processing in finish
        self.post_param_sync = post_param_sync  # >= 0.18: _post_param_sync, forced syncs too
        self.fp4_param_gather = fp4_param_gather  # >= 0.17: NVFP4 parameters gathered as such
        self.version = version


def mcore_features() -> McoreFeatures:
    """Probe the installed megatron-core (by what its module holds, not its version string)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from nemo_fp8_align.mcore_versions import installed_version  # megatron-core installed: on use

    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    return McoreFeatures(hasattr(pgb, "post_all_gather_processing"),
                         callable(getattr(getattr(pgb, "_ParamAndGradBucketGroup", None),
                                          "_post_param_sync", None)),  # no bucket groups < 0.9
                         installed_version(),  # 0.7.0's megatron.core has no __version__
                         fp4_param_gather="fp4_param_gather" in fields)


#: The first megatron-core version that aligns each block-scaled kind (module docstring).
SINCE = {COLUMNWISE: "0.16", NVFP4_TRANSPOSE: "0.17", REQUANTIZE: "0.18"}


def _need(kind: str, features: Optional[McoreFeatures], path: str) -> Optional[str]:
    """Why ``kind`` cannot be aligned here (None: it can)."""
    if kind == TRANSPOSE:
        return None
    what = {COLUMNWISE: "blockwise FP8 (its column-wise copy)",
            NVFP4_TRANSPOSE: "NVFP4 (its 2D transpose)",
            REQUANTIZE: "MXFP8 with reuse_grad_buf_for_mxfp8_param_ag (its re-quantization)"}[kind]
    fix = f"Fix: megatron-core >= {SINCE[kind]}, {_OFF}"
    if features is None:
        return (f"{what}: on {path} the plugin would have to build it itself, and it never "
                "byte-transposes block-scaled data; nothing places TE's own post-processing "
                f"there. Fix: megatron-core's DDP with its distributed optimizer "
                f"(>= {SINCE[kind]}), {_OFF}")
    if not features.post_processes:
        return (f"{what}: megatron-core {features.version} runs no post-all-gather processing "
                "(>= 0.16 does, in finish_param_sync), so it is built at each rank's first use "
                f"and the plugin never byte-transposes block-scaled data. {fix}")
    if kind == NVFP4_TRANSPOSE and not features.fp4_param_gather:
        return (f"{what}: megatron-core {features.version} has no fp4_param_gather, so NVFP4 "
                "parameters are neither gathered nor post-processed as NVFP4 (>= 0.17 does "
                f"both). {fix}")
    if kind == REQUANTIZE and not features.post_param_sync:
        return (f"{what}: on megatron-core {features.version} a forced synchronous all-gather "
                "(evaluation, checkpoint save) leaves the MXFP8 parameters un-requantized, "
                "which only megatron-core's code could redo (>= 0.18 runs _post_param_sync "
                f"after it). {fix}")
    return None


def recipe_refusals(kinds: Sequence[str], features: Optional[McoreFeatures],
                    path: str = "megatron-core") -> List[str]:
    """One sentence per kind of ``kinds`` that cannot be aligned (``features`` None: a path
    where the plugin builds the work itself, e.g. NeMo's Apex optimizer)."""
    out = []
    for kind in sorted(set(kinds)):
        why = _need(kind, features, path)
        if why is not None:
            out.append(why)
    return out


def refuse_recipes(kinds: Sequence[str], features: Optional[McoreFeatures],
                   path: str = "megatron-core") -> None:
    """Raise :class:`~nemo_fp8_align.errors.UnsupportedSetupError` naming every kind that
    cannot be aligned here."""
    messages = recipe_refusals(kinds, features, path)
    if messages:
        raise UnsupportedSetupError("nemo_fp8_align cannot align this recipe here:\n"
                                    + "\n".join(f"  - {m}" for m in messages))


def weights_with_work(weights: List[Any], backend: Any, *, requantized: bool) -> List[Any]:
    """``weights`` less the MXFP8 ones where megatron-core does not re-quantize them after the
    all-gather (``requantized``: the chunk's ``ddp_config.reuse_grad_buf_for_mxfp8_param_ag``):
    they carry no post-all-gather work, so there is nothing to align for them."""
    return [w for w in weights if requantized or kind_of(backend, w) != REQUANTIZE]


def kinds_of(weights: Sequence[Sequence[Any]], backend: Any) -> Dict[str, int]:
    """How many weights of each kind ``weights`` (per chunk) hold."""
    out: Dict[str, int] = {}
    for chunk in weights:
        for w in chunk:
            k = kind_of(backend, w)
            out[k] = out.get(k, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# The refused megatron-core setups


@dataclass(frozen=True)
class Setup:
    """What the rows read: the ``TransformerConfig`` the schedule reads."""

    config: Any


@dataclass(frozen=True)
class Refusal:
    """One setup the plugin refuses: the setting, where it lives, why, and the fix."""

    key: str
    setting: str  #: where megatron-core keeps it, e.g. ``TransformerConfig.cuda_graph_impl``
    versions: str  #: megatron-core versions whose config classes have the setting
    value: Callable[[Setup], Any]  #: the offending value, or None when the row does not fire
    why: str
    fix: str
    #: The value the startup check's fix sets ``model.<field>`` to in NeMo's config.
    nemo_fix: Any

    @property
    def field(self) -> str:
        """The ``TransformerConfig`` field, also the key of NeMo's model config."""
        return self.setting.rpartition(".")[2]

    def message(self, value: Any) -> str:
        return f"{self.setting}={value!r}: {self.why}. Fix: {self.fix}."


def _scope_names(config: Any) -> List[str]:
    scopes = getattr(config, "cuda_graph_scope", None) or []
    scopes = scopes if isinstance(scopes, (list, tuple)) else [scopes]
    return [getattr(s, "name", s) for s in scopes]  # str, or CudaGraphScope enum (>= 0.16)


def _whole_step_scope(setup: Setup) -> Optional[List[str]]:
    names = _scope_names(setup.config)
    return names if "full_iteration" in names else None


def _whole_step_impl(setup: Setup) -> Optional[str]:
    impl = getattr(setup.config, "cuda_graph_impl", None)
    return impl if impl == "full_iteration" else None


def _combined_1f1b(setup: Setup) -> Optional[bool]:
    return True if getattr(setup.config, "overlap_moe_expert_parallel_comm", False) else None


_REPLAY = ("replays of a captured step run no Python: no hook could place, time or check a "
           "transpose, and one captured inside would replay on the capture step's bytes")

#: The table, in report order.
REFUSALS = (
    Refusal("whole_step_graphs_scope", "TransformerConfig.cuda_graph_scope", "<= 0.17 (0.16.1, 0.17.1 read)",
            _whole_step_scope, "full_iteration captures whole training steps; " + _REPLAY,
            "per-layer CUDA graphs (cuda_graph_scope without full_iteration), or do not attach "
            "the plugin (policy=off)", "full"),
    Refusal("whole_step_graphs_impl", "TransformerConfig.cuda_graph_impl",
            ">= 0.18 (0.18.2, 0.19.2 read)",
            _whole_step_impl, "whole-step CUDA graphs (megatron-core >= 0.18 moves "
            "cuda_graph_scope=full_iteration here in TransformerConfig.__post_init__); "
            + _REPLAY, "cuda_graph_impl='local' or 'transformer_engine' (per-layer graphs), "
            "or do not attach the plugin (policy=off)", "transformer_engine"),
    Refusal("combined_1f1b", "TransformerConfig.overlap_moe_expert_parallel_comm",
            "0.16.1 to 0.19.2 read; not in 0.12.3",
            _combined_1f1b, "the combined 1F1B schedule runs the chunks' layers through its own "
            "schedule plan, so the model chunk's __call__ and the plugin's forward pre-hooks "
            "never run: no step could be counted or aligned",
            "overlap_moe_expert_parallel_comm=False, or do not attach the plugin (policy=off)",
            False),
)


def fired(setup: Setup) -> List[str]:
    """The message of every row that fires for ``setup``, in table order."""
    out = []
    for row in REFUSALS:
        value = row.value(setup)
        if value is not None:
            out.append(row.message(value))
    return out


def refuse_unsupported(setup: Setup) -> None:
    """Raise :class:`~nemo_fp8_align.errors.UnsupportedSetupError` naming every row that
    fires; return None when none does."""
    messages = fired(setup)
    if messages:
        raise UnsupportedSetupError(
            "nemo_fp8_align cannot align this megatron-core setup:\n"
            + "\n".join(f"  - {m}" for m in messages))


def refuse_path(config: Any, weights: Sequence[Sequence[Any]], backend: Any,
                features: Optional[McoreFeatures], path: str = "megatron-core") -> None:
    """What an optimizer's path refuses (``Adapter.weights_to_align``): the setups of
    ``config`` (the table above), then the recipes of ``weights`` (per chunk) that ``features``
    cannot post-process (None: a path where the plugin would build them itself)."""
    refuse_unsupported(Setup(config=config))
    refuse_recipes(list(kinds_of(weights, backend)), features, path)
