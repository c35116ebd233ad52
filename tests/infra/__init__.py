"""bwstack's node checks (pytest-testinfra): `pytest tests/infra --hosts=SPEC` or `bwstack verify --target SPEC`."""
