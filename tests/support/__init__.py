"""Test scaffolding, kept out of the installed package: the CPU patches that let NeMo 2.3.3 run
without a GPU (``cpu_nemo``, ``dist_checkpoint``, ``reference_fp8_layers``, ``run_nemo_cpu``) and
stand-ins for libraries that do not install here (``standins``: Apex's DistributedFusedAdam,
Transformer Engine's Float8Tensor per API generation), and every helper several test modules
share (``aligner_rank``: one simulated rank; ``demo_runs``: the demo runs cached per session;
``nemo_config``: the startup check's seed config; ``configs``, ``explicit_groups``,
``overrides``). Test modules import shared helpers from here, never from each other
(``tests/test_layout.py`` checks it). Importable as ``support`` with ``tests/`` on ``sys.path``
(pytest's ``pythonpath`` setting)."""
