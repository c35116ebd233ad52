"""`bwstack bench`: the performance figures of issue 8, each against its anchor measured in the same run.

  P1 build of a profile's env from a warm cache (a fresh store sharing the cache) vs `pip install` of the
     same closure from a local wheelhouse (and uv alone, for reference)
  P2 rollback: the switch itself and the whole `rollback` (manifest check + switch + import check) vs a
     reinstall of the env (pip from the wheelhouse, the field's way back)
  P3 snapshot of the active env: time and extra disk vs `cp -a`; both for an unchanged generation (its own
     backup) and for one someone pip-installed into (hard-link snapshot)
  P4 converged re-run of `bwstack provision` on this host (changed=0 expected), with its phases
  P5 `bwstack verify` of a sealed generation as a user runs it (the whole command): unchanged (its recorded
     facts reused) and after a file in it changed (cold: every fact read again)
  P6 image rebuild after an sglang-only bump vs a clean build
  P7 README's first command on a fresh clone with empty caches (bootstrap + provision, end to end, one run)
     vs `uv pip install` of the same closure from an empty cache plus `bwstack verify` alone, in the same run

Figures are wall-clock seconds: median, min and max of --runs runs. Ratios are anchor median / bwstack
median. `--quick` uses a small real closure (a subset of the lock's) so CI can check the harness works;
its numbers mean nothing. Goals are printed beside the figures; nothing here asserts them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from bwstack import paths
from bwstack.bench import BENCHES
from bwstack.lock.model import load_lock, spec_digest
from bwstack.lock.read import load_yaml, read_lock_text
from bwstack.lock.tags import Target, select
from bwstack.lock.uvtool import run_uv, uv_env
from bwstack.probe import envinspect, sealed
from bwstack.provision import backup, build, cudatk
from bwstack.provision.envbuild import find_python
from bwstack.provision.wheelhouse import Fetcher, Sources
from bwstack.store.generations import Store
from bwstack.store.layout import Layout
from bwstack.store.tree import remove_tree

QUICK_ROOTS = ("requests", "packaging", "typing-extensions")  # a small real closure from the cu128 lock
NVCC_WAIVER = "nvcc=NVIDIA's PyPI wheels for CUDA 12.x ship no nvcc"
_PHASE_LINE = re.compile(r"^  (\S.*?)\s{2,}(\d+(?:\.\d+)?) s\b")


def _phase_summary(stdout: str) -> str:
    """The phase lines `bwstack provision` printed, as "name N s, ..."."""
    found = [m.groups() for m in map(_PHASE_LINE.match, stdout.splitlines()) if m]
    return ", ".join(f"{name.strip()} {seconds} s" for name, seconds in found) or "(none printed)"


def _phase_total(stdout: str) -> float:
    found = re.search(r"^total (\d+(?:\.\d+)?) s", stdout, re.M)
    return float(found.group(1)) if found else float("nan")


def _drop_page_cache() -> None:
    """Empty the kernel's page cache (root only) so a "fresh" run reads from disk, as on a new node."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


class Outcome(Enum):
    """Whether a figure measured what it names. A figure that failed or did not run says why in its note, and
    makes `bwstack bench` exit non-zero: a table with a missing or failed row is not a result."""

    MEASURED = "measured"
    FAILED = "failed"  # the timed command (or its anchor) failed: the seconds are not those of a working run
    NOT_RUN = "not run"  # it could not start here (no checkout, no Docker, a generation left changed)


@dataclass
class Figure:
    bench: str
    what: str
    runs: list[float]
    unit: str = "s"
    anchor: str = ""
    anchor_runs: list[float] = field(default_factory=list)
    goal: str = ""
    note: str = ""
    outcome: Outcome = Outcome.MEASURED

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")

    @property
    def ratio(self) -> float | None:
        if not self.anchor_runs or not self.runs or self.median == 0:
            return None
        return statistics.median(self.anchor_runs) / self.median

    @classmethod
    def not_run(cls, bench: str, what: str, why: str) -> Figure:
        return cls(bench, what, [], note=f"not run: {why}", outcome=Outcome.NOT_RUN)

    @classmethod
    def failed(cls, bench: str, what: str, runs: list[float], why: str) -> Figure:
        return cls(bench, what, runs, note=f"FAILED: {why}", outcome=Outcome.FAILED)

    def as_dict(self) -> dict:
        return {**self.__dict__, "outcome": self.outcome.value, "median": self.median, "ratio": self.ratio}


def unmeasured(figures: list[Figure]) -> list[Figure]:
    """The figures that failed or did not run."""
    return [f for f in figures if f.outcome is not Outcome.MEASURED]


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _fmt(values: list[float], unit: str) -> str:
    if not values:
        return "-"
    if unit == "GiB":
        return f"{statistics.median(values):.3f} GiB"
    med = statistics.median(values)
    return (
        f"{med:.3f}s [{min(values):.3f}-{max(values):.3f}]"
        if med < 10
        else f"{med:.1f}s [{min(values):.1f}-{max(values):.1f}]"
    )


def render(figures: list[Figure]) -> str:
    header = "| bench | measured | bwstack median [min-max] | anchor | anchor median [min-max] | ratio | goal |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for f in figures:
        # Two decimals, rounded down: the goals are ratios like 0.5, and 0.46 shown as "0.5x" (or 0.496 as "0.50x")
        # read as met.
        ratio = f"{math.floor(f.ratio * 100) / 100:.2f}x" if f.ratio is not None else "-"
        what = f.what if f.outcome is Outcome.MEASURED else f"{f.what} ({f.outcome.value.upper()})"
        lines.append(
            f"| {f.bench} | {what} | {_fmt(f.runs, f.unit)} | {f.anchor or '-'} | {_fmt(f.anchor_runs, f.unit)} | "
            f"{ratio} | {f.goal or '-'} |"
        )
    notes = [f"- {f.bench} {f.what}: {f.note}" for f in figures if f.note]
    return "\n".join(lines + (["", *notes] if notes else []))


class Bench:
    def __init__(self, lock_path: Path, profile: str, work: Path, runs: int, quick: bool, log=print) -> None:
        self.work = work
        self.runs = runs
        self.quick = quick
        self.log = log
        # One cache for every store below (wheels and uv's unpacked files); an existing BWSTACK_CACHE is reused.
        self.cache = Path(os.environ.get("BWSTACK_CACHE") or work / "cache")
        os.environ["BWSTACK_CACHE"] = str(self.cache)
        self.lock_path = work / "bench.lock.yaml"
        self._write_lock(lock_path, profile)
        self.lock = load_lock(self.lock_path)
        self.profile = self.lock.profile("bench")
        self.twin = self.lock.profile("bench-unpatched")
        self.python = find_python(self.profile.python)

    def _write_lock(self, source: Path, profile: str) -> None:
        """The benchmarked profile as `bench` (in quick mode: a small real subset of its closure), plus a
        twin without patches, so that two real generations exist for the rollback figures."""
        doc = load_yaml(read_lock_text(Path(source)), str(source))
        spec = json.loads(json.dumps(doc["profiles"][profile]))
        closure = json.loads(json.dumps(doc["closures"][profile]))
        if self.quick:
            env = closure["env"]
            keep: set[str] = set()
            stack = list(QUICK_ROOTS)
            while stack:
                name = stack.pop()
                if name in env and name not in keep:
                    keep.add(name)
                    stack += [Requirement(r).name for r in env[name]["requires"]]
            closure["env"] = {k: v for k, v in env.items() if k in keep}
            spec["requirements"] = {k: env[k]["version"] for k in QUICK_ROOTS}
            spec["overrides"] = []
            spec["patches"] = []
        # The profile's CUDA toolkit goes into the scratch directory (P7 installs it from PyPI like a fresh node).
        spec["cuda"]["home"] = str(self.work / f"cuda-{'.'.join(str(spec['cuda']['version']).split('.')[:2])}")
        twin = json.loads(json.dumps(spec))
        twin["patches"] = []
        if self.quick:  # a second, different closure: drop one leaf package
            twin["requirements"] = {k: v for k, v in spec["requirements"].items() if k != "typing-extensions"}
        doc["profiles"] = {"bench": spec, "bench-unpatched": twin}
        twin_closure = json.loads(json.dumps(closure))
        if self.quick:
            twin_closure["env"].pop("typing-extensions", None)
        # Each derived closure is what resolving its derived spec gives (a subset, by construction): say so.
        closure["spec_digest"] = spec_digest(spec)
        twin_closure["spec_digest"] = spec_digest(twin)
        doc["closures"] = {"bench": closure, "bench-unpatched": twin_closure}
        doc["default_profile"] = doc["rollback_profile"] = "bench"
        self.work.mkdir(parents=True, exist_ok=True)
        self.lock_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    def layout(self, name: str) -> Layout:
        return Layout(self.work / name / "root", self.work / name / "ml-env", None, None, cache_dir=self.cache)

    def wheelhouse(self) -> Path:
        """The closure's wheels in one flat directory (links into the content-addressed store)."""
        wheels = Fetcher(self.cache / "wheels", Sources(), log=lambda m: None).fetch_all(
            select(self.profile.closure.env, Target.of(self.profile))
        )
        house = self.work / "wheelhouse"
        house.mkdir(exist_ok=True)
        for w in wheels.values():
            link = house / w.file
            if not link.exists():
                link.symlink_to(w.path)
        self.requirements = self.work / "requirements.txt"
        self.requirements.write_text(
            "".join(f"{w.package}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels.values())
        )
        return house

    # ---------------------------------------------------------------------------------------------- anchors

    def pip_install(self, house: Path) -> float:
        venv = self.work / "pip-venv"
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([self.python, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        seconds = _timed(lambda: subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house),
             "--require-hashes", "--no-deps", "-r", str(self.requirements)], check=True, env=env))  # fmt: skip
        shutil.rmtree(venv, ignore_errors=True)
        return seconds

    def uv_install(self) -> float:
        venv = self.work / "uv-venv"
        shutil.rmtree(venv, ignore_errors=True)
        env = uv_env({"UV_CACHE_DIR": str(self.cache / "uv")})
        run_uv(["venv", "--python", self.python, str(venv)], env=env, capture=True)
        seconds = _timed(lambda: run_uv(
            ["pip", "install", "--python", str(venv / "bin" / "python"), "--no-index", "--find-links",
             str(self.work / "wheelhouse"), "--require-hashes", "--no-deps", "-r", str(self.requirements)],
            env=env, capture=True))  # fmt: skip
        shutil.rmtree(venv, ignore_errors=True)
        return seconds

    # ---------------------------------------------------------------------------------------------- benches

    def p1(self) -> list[Figure]:
        house = self.wheelhouse()
        self.log("P1: warming the cache with one build ...")
        quiet = build.BuildOptions(switch=False)
        build.build(self.lock, self.profile, self.layout("warm"), quiet, log=lambda m: None)
        ours = []
        for i in range(self.runs):
            layout = self.layout(f"p1-{i}")
            started = time.perf_counter()
            build.build(self.lock, self.profile, layout, quiet, log=lambda m: None)
            ours.append(time.perf_counter() - started)
            remove_tree(layout.root.parent)
        self.log(f"P1: bwstack {ours}; pip from the wheelhouse ...")
        pip = [self.pip_install(house) for _ in range(self.runs)]
        uv = [self.uv_install() for _ in range(self.runs)]
        anchor = "pip install (local wheelhouse)"
        return [
            Figure("P1", "build env (warm cache), incl. verify + manifest", ours, anchor=anchor, anchor_runs=pip,
                   goal=">= 20x faster than pip"),
            Figure("P1", "uv install step alone (what bwstack runs)", uv, anchor=anchor, anchor_runs=pip,
                   note="the floor: uv hard-links from its cache"),
        ]  # fmt: skip

    def _two_generations(self) -> Store:
        layout = self.layout("p2")
        store = Store(layout, log=lambda m: None)
        if len(store.generations()) < 2:
            build.build(self.lock, self.profile, layout, build.BuildOptions(), log=lambda m: None)
            build.build(self.lock, self.twin, layout, build.BuildOptions(), log=lambda m: None)
        return store

    def p2(self, pip_runs: list[float]) -> list[Figure]:
        store = self._two_generations()
        layout = store.layout
        flips, totals, post = [], [], []
        for _ in range(self.runs):
            for target in (store.generations()[0], store.generations()[1]):
                started = time.perf_counter()
                result = build.rollback(self.lock, layout, to=target.name, log=lambda m: None)
                totals.append(time.perf_counter() - started)
                flips.append(result["switch"]["flip_s"])
                post.append(result["switch"]["post_check"]["seconds"])
        anchor = "reinstall (pip, wheelhouse)"
        note = f"of which the post-switch import of torch: median {statistics.median(post):.2f}s"
        return [
            Figure("P2", "switch (the atomic flip)", flips, anchor=anchor, anchor_runs=pip_runs,
                   goal="<= 1 s, >= 100x"),
            Figure("P2", "rollback command (verify + flip + import check)", totals, anchor=anchor, anchor_runs=pip_runs,
                   note=note),
        ]  # fmt: skip

    def p3(self) -> list[Figure]:
        store = self._two_generations()
        layout = store.layout
        env_bytes = sum(e.size for e in store.active().manifest_entries() if e.kind == "f")
        unchanged, unchanged_disk, drift, drift_disk, cp_time, cp_disk = [], [], [], [], [], []
        quiet = {"log": lambda m: None}
        for _ in range(self.runs):
            before = _inodes(layout.generations)
            unchanged.append(_timed(lambda: backup.backup(store, self.lock, **quiet)))
            unchanged_disk.append(_extra(layout.generations, before) / 2**30)
            site = envinspect.site_packages(store.active().env)
            # what a `pip install` into the env leaves behind: a new file (installers never write in place)
            (site / f"bench_drift_{time.time_ns()}.py").write_text("X = 1\n")
            before = _inodes(layout.generations)
            drift.append(_timed(lambda: backup.backup(store, self.lock, **quiet)))
            drift_disk.append(_extra(layout.generations, before) / 2**30)
            source, dest = str(store.active().env), self.work / "cp-a"
            started = time.perf_counter()
            subprocess.run(["cp", "-a", source, str(dest)], check=True)
            cp_time.append(time.perf_counter() - started)
            cp_disk.append(_du(dest) / 2**30)
            shutil.rmtree(dest)
        size = f"env {env_bytes / 2**30:.1f} GiB"
        return [
            Figure("P3", "snapshot, unchanged generation", unchanged, anchor="cp -a", anchor_runs=cp_time,
                   goal="<= 5 s"),
            Figure("P3", "extra disk, unchanged generation", unchanged_disk, unit="GiB", anchor="cp -a",
                   anchor_runs=cp_disk, goal="<= 1 % extra", note=size),
            Figure("P3", "snapshot after a pip install into it", drift, anchor="cp -a", anchor_runs=cp_time,
                   goal="<= 5 s"),
            Figure("P3", "extra disk after a pip install into it", drift_disk, unit="GiB", anchor="cp -a",
                   anchor_runs=cp_disk, goal="<= 1 % extra",
                   note=f"{size}; hard links: directories and changed files only"),
        ]  # fmt: skip

    def provision_cmd(self, base: Path, *more: str, python: str = sys.executable) -> list[str]:
        return [
            python, "-m", "bwstack", "--lock", str(self.lock_path), "provision", "--profile", "bench",
            "--allow-no-gpu", "--root", str(base / "root"), "--ml-env", str(base / "ml-env"), "--cuda-link", "none",
            "--skip", NVCC_WAIVER,
            "-e", json.dumps({"bwstack_tool_wrapper": ""}),  # a scratch store: not this machine's bwstack on PATH
            *more,
        ]  # fmt: skip

    def p4(self) -> list[Figure]:
        """`bwstack provision` (the playbooks, against this host) once to converge, then timed re-runs."""
        base = self.work / "p4"
        # The profile's CUDA toolkit from PyPI wheels into the scratch CUDA home (the first run; then converged).
        cmd = self.provision_cmd(base, "--min-free-gb", "5")
        env = {**os.environ, "BWSTACK_LOG_DIR": str(base / "logs")}
        first = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if first.returncode != 0:
            tail = " ".join(first.stdout.strip().splitlines()[-3:])[-300:]
            return [Figure.not_run("P4", "converged provision re-run", f"the first provision failed: {tail}")]
        figures = []
        # The re-run as a user runs it (the converged fast path: bwstack receipt, then verify), then with
        # --full, every role run again (what the fast path saves).
        for label, extra, goal in (
            ("converged provision re-run (this host)", [], "<= 12 s, changed=0"),
            ("the same with --full (every role runs)", ["--full"], "changed=0"),
        ):
            runs, changed, codes, last = [], [], [], ""
            for _ in range(self.runs):
                started = time.perf_counter()
                again = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env)
                runs.append(time.perf_counter() - started)
                changed += [int(c) for c in re.findall(r"changed=(\d+)", again.stdout)]
                codes.append(again.returncode)
                last = again.stdout
            note = f"changed= per run: {changed}" + ("" if not any(changed) else " (NOT converged)")
            if any(codes):
                note += f"; exit codes {codes}: {' '.join(last.strip().splitlines()[-3:])[-300:]}"
            note += f"; phases of the last run: {_phase_summary(last)}"
            # A re-run that changed something or failed timed another command than a converged one.
            outcome = Outcome.FAILED if any(changed) or any(codes) else Outcome.MEASURED
            figures.append(Figure("P4", label, runs, goal=goal, note=note, outcome=outcome))
        return figures

    def verify_cmd(self, env: Path) -> list[str]:
        return [sys.executable, "-m", "bwstack", "--lock", str(self.lock_path), "verify", "--env", str(env),
                "--profile", "bench", "--no-runtime", "--skip", NVCC_WAIVER]  # fmt: skip

    def p5(self) -> list[Figure]:
        """The whole `bwstack verify` command of a sealed generation: unchanged, then after a file changed."""
        store = self._two_generations()
        env = store.layout.ml_env
        if not Path(self.profile.cuda.home).exists():
            # The profile's toolkit as a provisioned node has it (the PyPI wheels of CUDA 12.x: no nvcc), so the
            # plans and the fix search are the node's, not those of an nvcc this machine has elsewhere.
            fetcher = Fetcher(self.cache / "wheels", Sources(), log=lambda m: None)
            cudatk.install_pip(self.profile, fetcher, cache_dir=self.cache / "uv", log=lambda m: None)
        gen = store.active()
        if gen is None or gen.profile != "bench":
            # The patched generation, as a provisioned node has it (P2 leaves either active): verified against the
            # profile it was not built from, a check fails in every run, and the figures would time the verify of
            # a failing node.
            patched = next(g for g in store.generations() if g.profile == "bench")
            build.rollback(self.lock, store.layout, to=patched.name, log=lambda m: None)
            gen = store.active()
            assert gen is not None
        if sealed.unchanged_generation(gen.env) is not None:
            # Left changed by an interrupted run (or by hand): back to its manifest, or the "unchanged" row would
            # time cold verifies.
            left = store.repair(gen)
            why = "; ".join(str(p) for p in left[:3]) or sealed.unchanged_generation(gen.env)
            if why:
                return [Figure.not_run("P5", "verify of a sealed generation", f"{gen.name}: {why}")]
        cmd = self.verify_cmd(env)
        codes: dict[str, list[int]] = {"first": [], "warm": [], "touched": [], "cold": [], "forgotten": []}

        def verify(kind: str) -> float:
            started = time.perf_counter()
            codes[kind].append(subprocess.run(cmd, capture_output=True, text=True).returncode)
            return time.perf_counter() - started

        verify("first")  # the first verify of a generation records its results
        warm = [verify("warm") for _ in range(self.runs)]
        site = next(gen.env.glob("lib/python3.*/site-packages"))
        # torch/version.py: every import check and SGLang's planner import it.
        changed = next(site.glob("torch/version.py"), None) or next(p for p in site.rglob("*.py") if p.is_file())
        original = changed.read_bytes()

        def other_bytes(note: str) -> None:
            """Other bytes in a file everything imports, as a new inode: never written through a link into the
            cache."""
            tmp = changed.with_name(f".{changed.name}.bench")
            tmp.write_bytes(original + f"# bwstack bench: {note}\n".encode())
            os.replace(tmp, changed)

        touched, cold = [], []
        for i in range(self.runs):
            # The mtime moved, the bytes as sealed (a `touch`): the tree is compared with the manifest, the moved
            # file hashed, and the recorded facts kept.
            os.utime(changed, ns=(time.time_ns(), time.time_ns() + i))
            touched.append(verify("touched"))
        for i in range(self.runs):
            # Every fact is read from the files again, the imports and SGLang's plans (and the fix search's) run
            # again.
            other_bytes(f"cold run {i}")
            cold.append(verify("cold"))
        forgotten = []
        for i in range(self.runs):
            # The same, with nothing remembered of earlier verifies (the store's verify cache of this generation
            # removed): the fix search's extra plans are not known in advance and start SGLang again.
            other_bytes(f"cold run {i}, nothing remembered")
            cache = sealed.derived_cache(gen.env)
            if cache is not None:
                cache.unlink(missing_ok=True)
            forgotten.append(verify("forgotten"))
        store.repair(gen)  # back to its manifest (the bench's scratch store)

        def outcome(kind: str, note: str) -> dict:
            """A verify that failed (a check, or the command) timed something other than a working env's verify."""
            exits = codes["first"] + codes[kind]
            if not any(exits):
                return {"note": note}
            return {"note": f"{note}; exit codes {exits}", "outcome": Outcome.FAILED}

        return [
            Figure("P5", "verify, unchanged sealed generation (whole command)", warm, goal="<= 2 s",
                   **outcome("warm", "static facts recorded at build time, import and serve-plan results of the "
                                     "last run reused after the generation's tree and the host were found unchanged")),
            Figure("P5", "verify, a file's mtime moved, its bytes as sealed (whole command)", touched,
                   **outcome("touched", "the tree compared with the manifest and the moved file hashed; the "
                                        "recorded facts and results reused")),
            Figure("P5", "verify, generation changed after sealing (cold, whole command)", cold, goal="<= 8 s",
                   **outcome("cold", f"{changed.relative_to(site)} given other bytes before each run: every fact "
                                     f"read from the files, the imports and SGLang's serve plans run again (the fix "
                                     f"search's extra plans beside the model's, as the last verify's fix search "
                                     f"asked for them)")),
            Figure("P5", "the same, nothing remembered of earlier verifies (cold, whole command)", forgotten,
                   goal="<= 8 s",
                   **outcome("forgotten", "the generation's verify cache removed before each run: the fix search "
                                          "starts SGLang again for its candidates")),
        ]  # fmt: skip

    def p7(self) -> list[Figure]:
        """README's first command on a fresh clone with empty caches, against uv's cold install + verify."""
        base = self.work / "p7"
        remove_tree(base)
        base.mkdir(parents=True)
        source = paths.checkout()
        if source is None:
            return [Figure.not_run("P7", "fresh node", "bwstack is not running from a checkout")]
        clone = base / "clone"
        subprocess.run(["git", "clone", "-q", str(source), str(clone)], check=True)
        toolkit = Path(self.profile.cuda.home)
        if toolkit.exists():  # a toolkit left by an earlier run: the fresh node has none
            remove_tree(toolkit)
        env = {k: v for k, v in os.environ.items() if k not in ("BWSTACK_CACHE", "VIRTUAL_ENV")}
        env.update({
            "BWSTACK_CACHE": str(base / "cache"),  # the store's wheels and uv's cache: empty
            "UV_CACHE_DIR": str(base / "uv-cache"),  # bootstrap's uv: empty
            "PIP_NO_CACHE_DIR": "1",  # pip (bootstrap's uv install, the node's tool venv): no cache
            "BWSTACK_LOG_DIR": str(base / "logs"),
        })  # fmt: skip
        _drop_page_cache()
        command = ["bash", "-c", 'scripts/bootstrap.sh && exec "$@"', "bootstrap",
                   *self.provision_cmd(base, python=str(clone / ".venv" / "bin" / "python"))]  # fmt: skip
        started = time.perf_counter()
        fresh = subprocess.run(command, cwd=clone, capture_output=True, text=True, env=env)
        ours = time.perf_counter() - started
        if fresh.returncode != 0:
            tail = " ".join(fresh.stdout.strip().splitlines()[-4:])[-400:]
            return [Figure.failed("P7", "fresh node: README's first command", [ours], tail)]
        # The anchor: the same closure installed by uv from an empty cache (PyPI), then `bwstack verify` alone.
        venv = base / "uv-venv"
        uv_cache = base / "uv-cold-cache"
        uv = uv_env({"UV_CACHE_DIR": str(uv_cache)})
        run_uv(["venv", "--python", self.python, str(venv)], env=uv, capture=True)
        requirements = base / "requirements.txt"
        wheels = select(self.profile.closure.env, Target.of(self.profile))
        requirements.write_text("".join(f"{p.name} @ {w.url} --hash=sha256:{w.sha256}\n" for p, w in wheels.values()))
        _drop_page_cache()
        install = ["pip", "install", "--python", str(venv / "bin" / "python"), "--no-deps", "--require-hashes",
                   "-r", str(requirements)]  # fmt: skip
        installed: list[subprocess.CompletedProcess] = []
        uv_seconds = _timed(lambda: installed.append(run_uv(install, env=uv, capture=True)))
        if installed[0].returncode != 0:
            tail = installed[0].stderr.strip()[-300:]
            return [Figure.failed("P7", "fresh node: README's first command", [ours], f"the anchor's uv: {tail}")]
        # "bwstack verify alone" verifies what uv installed: a cold verify, nothing of it known before (no store,
        # no bytecode). The provisioned env's verify (warm: its first verify ran inside the command) is kept as
        # the anchor the figures before stop 28 used.
        verified: list[subprocess.CompletedProcess] = []
        verify_seconds = _timed(lambda: verified.append(subprocess.run(self.verify_cmd(venv), capture_output=True)))
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(uv_cache, ignore_errors=True)
        warm_seconds = _timed(lambda: subprocess.run(self.verify_cmd(base / "ml-env"), capture_output=True))
        bootstrap = re.search(r"bootstrap: \.venv ready \((\d+) s", fresh.stderr + fresh.stdout)
        phases = f"bootstrap {bootstrap.group(1)} s, " if bootstrap else ""
        phases += _phase_summary(fresh.stdout)
        # The converged re-run of the same command (everything in place), for the phases the issue asks for.
        again = subprocess.run(command, cwd=clone, capture_output=True, text=True, env=env)
        return [
            Figure("P7", "fresh node: README's first command (empty caches, end to end)", [ours],
                   anchor="uv pip install, cold cache + bwstack verify of that env",
                   anchor_runs=[uv_seconds + verify_seconds], goal="<= 2x the anchor (ratio >= 0.5)",
                   note=f"one run each; anchor = uv {uv_seconds:.1f} s + verify of uv's env {verify_seconds:.1f} s "
                        f"(exit {verified[0].returncode}); with the provisioned env's warm verify instead "
                        f"({warm_seconds:.1f} s, the anchor before stop 28): ratio "
                        f"{(uv_seconds + warm_seconds) / ours:.2f}; "
                        f"phases: {phases}"),
            Figure("P7", "the same command again (converged)", [_phase_total(again.stdout)],
                   note=f"phases: {_phase_summary(again.stdout)}" + (f"; exit {again.returncode}: "
                        f"{' '.join(again.stdout.strip().splitlines()[-3:])[-300:]}" if again.returncode else ""),
                   outcome=Outcome.FAILED if again.returncode else Outcome.MEASURED),
        ]  # fmt: skip

    def p6(self) -> list[Figure]:
        """Clean image build, then a rebuild after an sglang-only bump (one run each: minutes per build)."""
        from bwstack.image import bench
        from bwstack.image.build import ImageBuildOptions

        try:
            base = bench.ensure_bench_base()
            with tempfile.TemporaryDirectory(prefix="bwstack-bench-") as tmp:
                bumped = bench.sglang_only_bump(str(self.lock_path), "bench", "0.5.10", Path(tmp, "b.lock.yaml"))
                opts = ImageBuildOptions(wheelhouses=(str(self.work / "wheelhouse"),), base_image=base)
                result = bench.bench_rebuild(str(self.lock_path), str(bumped), "bench", opts=opts, log=lambda m: None,
                                             out=lambda m: None)  # fmt: skip
        except Exception as exc:  # no daemon or base image: the table says so
            return [Figure.not_run("P6", "image rebuild after an sglang bump", str(exc))]
        note = (
            f"base {base}; changed layers {list(result.changed_layers)}; {len(result.rebuilt_run_steps)} RUN steps "
            f"rebuilt, {result.cached_steps} of {result.steps} steps from cache; one run each"
        )
        return [Figure("P6", "image rebuild after an sglang-only bump", [result.rebuild_seconds],
                       anchor="clean build", anchor_runs=[result.clean_build_seconds], note=note)]  # fmt: skip


def _inodes(path: Path) -> set[tuple[int, int]]:
    seen = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            seen.add((st.st_dev, st.st_ino))
    return seen


def _extra(path: Path, before: set[tuple[int, int]]) -> int:
    """Bytes of inodes under path that did not exist before (what a snapshot really added)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in before:
                total += st.st_blocks * 512
                before.add((st.st_dev, st.st_ino))
    return total


def _du(path: Path) -> int:
    return _extra(path, set())


def compile_own_bytecode() -> None:
    """bwstack's own modules and those of the interpreter it runs in (pytest, testinfra, PyYAML: what its
    commands import) compiled to bytecode, as an installed bwstack has them (pip compiles on install; the node's
    tool venv is such an install), before any command is timed. From a checkout Python writes them on the first
    run, unless PYTHONDONTWRITEBYTECODE is set (as on this project's machines), and uv installs the checkout's
    .venv without them: then every timed command compiled its modules from source, 0.4 s of bwstack's and
    0.3-0.5 s of its dependencies' in a 2 s verify that no user's command pays."""
    import compileall
    import sysconfig

    folders = {str(Path(paths.__file__).parent)}
    if sys.prefix != sys.base_prefix:  # bwstack's own venv; a system interpreter's folders are its packager's
        folders |= {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    for folder in sorted(folders):
        compileall.compile_dir(folder, quiet=2, workers=0)


def run(lock: str, profile: str, work: str, runs: int, quick: bool, only: list[str] | None, log=print) -> list[Figure]:
    compile_own_bytecode()
    bench = Bench(Path(lock), profile, Path(work), runs, quick, log)
    wanted = set(only or BENCHES)
    figures: list[Figure] = []
    pip_runs: list[float] = []
    if "P1" in wanted or "P2" in wanted:
        p1 = bench.p1()
        pip_runs = p1[0].anchor_runs
        if "P1" in wanted:
            figures += p1
    for key, fn in (
        ("P2", lambda: bench.p2(pip_runs)),
        ("P3", bench.p3),
        ("P4", bench.p4),
        ("P5", bench.p5),
        ("P6", bench.p6),
        ("P7", bench.p7),
    ):
        if key in wanted:
            log(f"{key} ...")
            figures += fn()
    return figures


def machine() -> str:
    cpus = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpus} cores, {mem:.0f} GiB RAM, Python {sys.version.split()[0]}, {os.uname().sysname} {os.uname().release}"
    )
