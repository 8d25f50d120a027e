"""Triton kernels (one module per op). Import the op modules directly; they import Triton."""
