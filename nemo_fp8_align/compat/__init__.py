"""Compatibility shims for running megatron-core (and NeMo) on the CPU with gloo.

Used by the CPU demo, the CPU smoke run and the tests only; they refuse to activate when a CUDA
GPU is present, so they can never change behaviour on a real training machine.
"""
