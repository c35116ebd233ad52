"""`bwstack serve-plan`: what SGLang will really run for a model on the target GPU, with the kernels behind
every path.

Node side (standard library only, shipped in the probe zipapp): `references` (the built-in model configs),
`inenv` (the script that runs inside the env's interpreter and observes SGLang's own choices), `node` (runs it
with the target simulated or the real GPU, and reads the kernels the chosen paths need). Controller side: `records`
(typed records), `catalogue` (field reports), `assemble` (the plan and its verdicts), `render`, `cli`.
"""
