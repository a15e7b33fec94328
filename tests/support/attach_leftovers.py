"""What an attach may install on megatron-core DDP chunks, found still there after it failed or
was undone (tests/test_entry_points.py, tests/test_doc_snippets.py)."""

from nemo_fp8_align.core import aligner as claims
from nemo_fp8_align.class_patch import patched_methods


def module_hooks(chunks):
    """The forward (pre-)hook counts of each chunk and its module (DDP has pre-hooks of its own:
    compare with the counts taken before the attach)."""
    return [(len(m._forward_pre_hooks), len(m._forward_hooks))
            for chunk in chunks for m in (chunk, chunk.module)]


def leftovers(chunks, config, bound, hooks):
    """Everything still there: ``bound`` is ``config.param_sync_func`` and ``hooks`` the
    :func:`module_hooks` counts before the attach."""
    now = module_hooks(chunks)
    found = [] if now == hooks else [f"hooks {now}, were {hooks}"]
    for c, chunk in enumerate(chunks):
        found += [f"chunk {c}.{n}" for n in ("start_param_sync", "finish_grad_sync")
                  if n in vars(chunk)]
        if claims.holder_of(chunk) is not None:
            found.append(f"claim on chunk {c}")
        found += [f"chunk {c} bucket group wrapped" for g in chunk.bucket_groups
                  if "start_param_sync" in vars(g)]
    if config.param_sync_func is not bound:
        found.append("config.param_sync_func replaced")
    found += [f"class patch {k}" for k in patched_methods()]
    return found
