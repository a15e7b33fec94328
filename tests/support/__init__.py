"""Test scaffolding, kept out of the installed package: the CPU patches that let NeMo 2.3.3 run
without a GPU (``cpu_nemo``, ``dist_checkpoint``, ``reference_fp8_layers``, ``run_nemo_cpu``) and
stand-ins for libraries that do not install here (``standins``: Apex's DistributedFusedAdam).
Importable as ``support`` with ``tests/`` on ``sys.path`` (pytest's ``pythonpath`` setting)."""
