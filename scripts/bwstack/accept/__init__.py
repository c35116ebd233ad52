"""Node acceptance: is this node's driver, PCIe fabric and first all-reduce fit to serve?

Node-side modules (standard library only: they ship in the probe zipapp, where preflight uses them):
`machine` (where facts are read: a root directory and a command runner), `facts` (the typed facts),
`pcie`, `driver`, `kernel` (the readers), `judge` (pass / warn / fail against the target).
Controller-side: `runtime` (GPU measurements in child processes with a hard timeout), `gpu_worker` (what
those children run, with the env's torch), `runtime_judge`, `report`, `command` (`bwstack accept`).
"""
