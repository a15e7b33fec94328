"""Where the callbacks detach with an agreement (issue 40): at the end of training, which every
rank reaches at the same point, ``detach(agree=True)`` (what a rank still holds stops every
rank: tests/test_no_hang.py, tests/test_megatron_lm_loop.py); on the paths where the ranks do
not detach together (an exception on its way out, a restart onto another model), locally."""

from types import SimpleNamespace

import pytest


def _recording_aligner(calls):
    return SimpleNamespace(detach=lambda **kw: calls.append(kw))


def test_bridge_detaches_with_an_agreement_at_trains_end_only():
    from nemo_fp8_align.integrations.bridge import FP8TransposeAlignCallback

    chunks, calls = [object(), object()], []
    for context, agree in ((SimpleNamespace(model=chunks), True),  # train()'s end
                           (SimpleNamespace(model=[object(), object()]), False),  # a restart
                           (None, False)):  # called by hand on an error path
        callback = FP8TransposeAlignCallback()
        callback.aligner, callback._chunks = _recording_aligner(calls), list(chunks)
        callback.on_train_end(context)
        assert calls.pop() == {"agree": agree}
        assert callback.aligner is None and callback._chunks == []


def test_nemo2_detaches_with_an_agreement_at_train_end_and_locally_on_an_exception():
    pytest.importorskip("lightning")
    try:
        from nemo_fp8_align.integrations.nemo2 import FP8TransposeAlignNeMo2
    except ImportError as err:  # NeMo 2's own imports (nemo.lightning) are not installed
        pytest.skip(str(err))

    calls = []
    callback = FP8TransposeAlignNeMo2()
    callback.aligner = _recording_aligner(calls)
    callback.on_train_end(None, None)
    assert calls == [{"agree": True}] and callback.aligner is None
    callback.aligner = _recording_aligner(calls)
    callback.on_exception(None, None, RuntimeError("x"))
    assert calls[-1] == {} and callback.aligner is None  # local: the error is on its way out
