"""The image layer: the serving image of one lock profile, built and checked through the Docker SDK.

    context.py  what goes into the build context (Dockerfile, per-layer requirement files, toolkit, OS packages)
    wheels.py   the build's wheels: found in wheelhouses and hash-checked on the host, or downloaded
    tool.py     tool.tar: bwstack itself as the build's RUN steps run it
    server.py   the build-time server: an authenticating proxy for one build's inputs on the Docker bridge
    daemon.py   the Docker daemon: client, bridge gateway, base image facts
    labels.py   the public build args: OCI labels, versions, digests
    build.py    `image build`: the orchestration, ImageBuildOptions -> ImageBuildResult
    scan.py     what must never be in an image: CA or secrets in its history, a CA copied into a layer
    verify.py   `image verify`: tests/infra's node and image checks against a container of the image
    bench.py    `image bench-rebuild`: clean build, then an app-only bump on its cache
    (the `bwstack image` command line is bwstack.cli.commands.image)

docker/ (the Dockerfile and its step script) ships with the package as `bwstack_docker`.
"""

DEFAULT_BUILD_PORT = 0  # any free port: the address reaches the build in http_proxy, outside the cache key
