"""The command line, the top layer: the only one that reads argv or writes to the terminal.

main.py       main(): the parser, assembled from the registry, and the error handlers (one line, exit codes,
              BWSTACK_DEBUG=1 for the traceback)
commands/     one module per command: NAME, HELP, add_options(parser), run(args) -> int
options.py    the shared option groups (sources, store location, target + SSH, --skip, --profile, --json),
              the argument types, and the typed values built from them for the layers below
console.py    Console: human lines and the result; under --json stdout is one JSON document only
"""
