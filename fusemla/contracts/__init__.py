"""The ops' argument contracts: what each op takes, checked once (shapes, dtypes, strides,
devices, formats), below both the Triton launchers (``fusemla.ops``) and the plain-PyTorch
references (``fusemla.reference``), which import it and nothing of each other's but the
launcher's CPU fallback to the reference."""
