"""Validation runs: the real-stack harnesses (real Transformer Engine, megatron-core and Apex on a
GPU), the NeMo CPU smoke run, and the tools that bring Transformer Engine to the H200 machine.

Not part of the installed package: run from a checkout (``python3 validation/NAME.py``); the tests
import it as a package.
"""
