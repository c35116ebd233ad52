"""bwstack.provision.patches against real sglang wheels from PyPI: hash-guarded, idempotent, reversible, atomic."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import py_compile
import sys
import types
from pathlib import Path

import pytest
from realwheels import site_packages, wheel_bytes

from bwstack.errors import PreflightError, UsageError
from bwstack.lock import patch_catalogue
from bwstack.provision import patches
from bwstack.provision.patches import PatchRefusedError

PATCH = "sglang-sm120-symm-mem"
UTILS = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
SYMM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
MiB = 1024 * 1024

# One real release per catalogue family (first of each, except the newest release for the last family).
FAMILY_RELEASES = ["0.5.9", "0.5.12", "0.5.14", "0.5.16", "0.5.23"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def family(version: str) -> patch_catalogue.Family:
    fam = patch_catalogue.catalogue()[PATCH].family_for(version)
    assert fam is not None
    return fam


def hashes(version: str, which: str) -> dict[str, str]:
    return {f.path: getattr(f, f"{which}_sha256") for f in family(version).files}


def fingerprint(path: Path) -> tuple:
    st = path.stat()
    return path.read_bytes(), st.st_ino, st.st_mtime_ns


@pytest.fixture
def sp059(tmp_path: Path) -> Path:
    return site_packages(tmp_path, ("sglang", "0.5.9"))


def make_pyc(sp: Path, rel: str) -> Path:
    source = sp / rel
    return Path(py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)), doraise=True))


# ---------------------------------------------------------------------------------------------- sglang 0.5.9


@pytest.mark.network
def test_the_0_5_9_wheel_ships_the_hashes_the_catalogue_calls_original(sp059: Path) -> None:
    assert {rel: sha(sp059 / rel) for rel in (UTILS, SYMM)} == hashes("0.5.9", "original")
    assert hashes("0.5.9", "original") == {
        UTILS: "df4c56d0dc1293c41caa3bc27779bc58eb2823f89aef70b21911a90a259864e4",
        SYMM: "95a6a7703c6d3ccd5a8e106c4a35c2715052acd78d48b0fb58f5a3e24c443e90",
    }


@pytest.mark.network
def test_status_of_an_untouched_install_is_original(sp059: Path) -> None:
    [state] = patches.status(sp059, [PATCH])
    assert (state.state, state.version, state.versions) == ("original", "0.5.9", ">=0.5.4.post3,<=0.5.11")
    assert [f.state for f in state.files] == ["original", "original"]


@pytest.mark.network
def test_apply_makes_both_files_the_known_patched_files(sp059: Path) -> None:
    [result] = patches.apply(sp059, [PATCH])
    assert result.action == "applied"
    assert {rel: sha(sp059 / rel) for rel in (UTILS, SYMM)} == hashes("0.5.9", "patched")
    assert hashes("0.5.9", "patched") == {  # what the seed's hand patch produced (stack-facts)
        UTILS: "7cd27f0df37e0f4e4593cb42819914543f7f0ddb476ad2b91a2f5c9dba1aeeed",
        SYMM: "f7485f291abff961cc9b6404728b8ca6ae862ef804c8cca65b23992840d785c5",
    }
    assert patches.status(sp059, [PATCH])[0].state == "applied"


@pytest.mark.network
def test_apply_returns_what_the_generation_record_stores(sp059: Path) -> None:
    [result] = patches.apply(sp059, [PATCH])
    record = json.loads(json.dumps(result.as_dict()))
    assert (record["patch_id"], record["package"], record["version"]) == (PATCH, "sglang", "0.5.9")
    assert {f["path"]: f["sha256"] for f in record["files"]} == hashes("0.5.9", "patched")
    assert {f["path"]: f["sha256_before"] for f in record["files"]} == hashes("0.5.9", "original")
    assert {f["action"] for f in record["files"]} == {"patched"}


@pytest.mark.network
def test_status_is_json_serialisable(sp059: Path) -> None:
    payload = json.dumps([s.as_dict() for s in patches.status(sp059, [PATCH])])
    assert json.loads(payload)[0]["files"][1]["path"] == SYMM


@pytest.mark.network
def test_apply_twice_changes_nothing_and_says_already_applied(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    before = {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)}
    [again] = patches.apply(sp059, [PATCH])
    assert again.action == "already applied"
    assert {f.action for f in again.files} == {"unchanged"}
    assert {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)} == before


@pytest.mark.network
def test_revert_restores_the_wheels_bytes_exactly(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    [result] = patches.revert(sp059, [PATCH])
    assert result.action == "reverted"
    for rel in (UTILS, SYMM):
        assert (sp059 / rel).read_bytes() == wheel_bytes("sglang", "0.5.9", rel)
    assert patches.status(sp059, [PATCH])[0].state == "original"


@pytest.mark.network
def test_revert_of_an_unpatched_install_is_a_no_op(sp059: Path) -> None:
    before = {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)}
    [result] = patches.revert(sp059, [PATCH])
    assert result.action == "already original"
    assert {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)} == before


@pytest.mark.network
def test_apply_refuses_a_modified_file_names_it_and_touches_neither_file(sp059: Path) -> None:
    with (sp059 / SYMM).open("a") as handle:
        handle.write("# local change\n")
    modified = sha(sp059 / SYMM)
    before = {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)}
    with pytest.raises(PatchRefusedError) as caught:
        patches.apply(sp059, [PATCH])
    assert str(sp059 / SYMM) in str(caught.value)
    assert modified in str(caught.value)
    assert (caught.value.path, caught.value.sha256) == (SYMM, modified)
    assert isinstance(caught.value, PreflightError)  # the CLI's "nothing was touched" exit code
    assert {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)} == before  # UTILS comes first: untouched
    assert patches.status(sp059, [PATCH])[0].state == "unknown"


@pytest.mark.network
def test_revert_refuses_a_modified_patched_file_and_touches_neither_file(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    (sp059 / UTILS).write_text((sp059 / UTILS).read_text() + "\n")
    before = {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)}
    with pytest.raises(PatchRefusedError, match=sha(sp059 / UTILS)):
        patches.revert(sp059, [PATCH])
    assert {rel: fingerprint(sp059 / rel) for rel in (UTILS, SYMM)} == before


@pytest.mark.network
def test_apply_refuses_when_a_file_is_missing(sp059: Path) -> None:
    (sp059 / SYMM).unlink()
    with pytest.raises(PatchRefusedError, match=r"torch_symm_mem\.py is missing"):
        patches.apply(sp059, [PATCH])
    assert sha(sp059 / UTILS) == hashes("0.5.9", "original")[UTILS]


@pytest.mark.network
def test_a_half_applied_install_is_partial_and_apply_finishes_it(sp059: Path, tmp_path: Path) -> None:
    other = site_packages(tmp_path, ("sglang", "0.5.9"), name="other")
    patches.apply(other, [PATCH])
    (sp059 / SYMM).write_bytes((other / SYMM).read_bytes())  # as if interrupted between the two renames
    assert patches.status(sp059, [PATCH])[0].state == "partial"
    [result] = patches.apply(sp059, [PATCH])
    assert {f.path: f.action for f in result.files} == {UTILS: "patched", SYMM: "unchanged"}
    assert {rel: sha(sp059 / rel) for rel in (UTILS, SYMM)} == hashes("0.5.9", "patched")


@pytest.mark.network
def test_apply_removes_stale_bytecode_of_the_patched_files_only(sp059: Path) -> None:
    stale = [make_pyc(sp059, UTILS), make_pyc(sp059, SYMM)]
    opt = stale[0].with_name(stale[0].name.replace(".pyc", ".opt-1.pyc"))
    opt.write_bytes(stale[0].read_bytes())
    (sp059 / "sglang/srt/distributed/device_communicators/all_reduce_utils_other.py").write_text("X = 1\n")
    bystander = make_pyc(sp059, "sglang/srt/distributed/device_communicators/all_reduce_utils_other.py")
    [result] = patches.apply(sp059, [PATCH])
    assert not any(p.exists() for p in [*stale, opt])
    assert bystander.exists()
    removed = {p for f in result.files for p in f.bytecode_removed}
    assert removed == {p.relative_to(sp059).as_posix() for p in [*stale, opt]}


@pytest.mark.network
def test_revert_removes_stale_bytecode(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    stale = [make_pyc(sp059, UTILS), make_pyc(sp059, SYMM)]
    patches.revert(sp059, [PATCH])
    assert not any(p.exists() for p in stale)


@pytest.mark.network
def test_apply_keeps_the_file_mode(sp059: Path) -> None:
    os.chmod(sp059 / SYMM, 0o640)
    os.chmod(sp059 / UTILS, 0o444)  # read-only files are replaced by rename, not opened for writing
    patches.apply(sp059, [PATCH])
    assert (sp059 / SYMM).stat().st_mode & 0o7777 == 0o640
    assert (sp059 / UTILS).stat().st_mode & 0o7777 == 0o444


@pytest.mark.network
def test_apply_breaks_hard_links_instead_of_writing_through_them(sp059: Path, tmp_path: Path) -> None:
    cache_copy = tmp_path / "uv-cache-copy.py"  # uv installs by hard-linking files from its cache
    os.link(sp059 / SYMM, cache_copy)
    patches.apply(sp059, [PATCH])
    assert sha(cache_copy) == hashes("0.5.9", "original")[SYMM]
    assert sha(sp059 / SYMM) == hashes("0.5.9", "patched")[SYMM]


@pytest.mark.network
def test_apply_leaves_no_temporary_files(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    patches.revert(sp059, [PATCH])
    assert not [p for p in (sp059 / SYMM).parent.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ the patched code


def load_module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.network
def test_patched_all_reduce_utils_imports_and_gives_capability_12_the_sm100_sizes(sp059: Path) -> None:
    patches.apply(sp059, [PATCH])
    sizes = load_module(sp059 / UTILS, "patched_all_reduce_utils").TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES
    assert sizes[12] == {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB} == sizes[10]


BF16 = types.SimpleNamespace(itemsize=2)


class FakeTensor:
    """Just enough of a bf16 CUDA tensor for TorchSymmMemCommunicator.all_reduce() to run."""

    dtype, device = BF16, "cuda:0"

    def __init__(self, n: int = 1024) -> None:
        self.n, self.shape = n, (n,)

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 2

    def __getitem__(self, _index: object) -> FakeTensor:
        return self

    def view(self, *_shape: object) -> FakeTensor:
        return self

    def copy_(self, _other: object) -> FakeTensor:
        return self


def symm_mem_with_fake_torch(
    monkeypatch: pytest.MonkeyPatch, sp: Path, capability: int, world_size: int, multicast_ptr: int
) -> tuple[object, list[str]]:
    """Execute the installed torch_symm_mem.py with stand-ins for torch and sglang's other modules, and build
    a TorchSymmMemCommunicator as a `capability`.x GPU would. This runs sglang's real Python logic (table
    lookups, the multicast check, kernel choice); it proves nothing about the CUDA kernels themselves."""
    calls: list[str] = []
    torch = types.ModuleType("torch")
    torch.device = lambda spec: spec
    torch.Tensor = FakeTensor
    torch.bfloat16 = BF16
    torch.cuda = types.SimpleNamespace(set_device=lambda d: None, get_device_capability=lambda d=None: (capability, 0))
    torch.empty_like = lambda t: FakeTensor(t.n)
    record = lambda kind: lambda *a: calls.append(kind)  # noqa: E731
    torch.ops = types.SimpleNamespace(
        symm_mem=types.SimpleNamespace(multimem_all_reduce_=record("multimem"), two_shot_all_reduce_=record("two_shot"))
    )
    dist = types.ModuleType("torch.distributed")
    dist.ProcessGroup = object
    dist.get_world_size = lambda group: world_size
    symm = types.ModuleType("torch.distributed._symmetric_memory")
    symm.empty = lambda n, device, dtype: FakeTensor(n)
    symm.rendezvous = lambda buf, name: types.SimpleNamespace(multicast_ptr=multicast_ptr)
    torch.distributed, dist._symmetric_memory = dist, symm
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda, utils.is_hip = (lambda: True), (lambda: False)
    environ = types.ModuleType("sglang.srt.environ")  # 0.5.16+
    environ.envs = types.SimpleNamespace(SGLANG_OPT_USE_INKLING_CUSTOM_AR=types.SimpleNamespace(get=lambda: False))
    runtime = types.ModuleType("sglang.srt.runtime_context")  # 0.5.17+
    runtime.get_exec = runtime.get_server_args = lambda: None
    pkg = "sglang.srt.distributed.device_communicators"
    for name, module in {
        "torch": torch,
        "torch.distributed": dist,
        "torch.distributed._symmetric_memory": symm,
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.utils": utils,
        "sglang.srt.environ": environ,
        "sglang.srt.runtime_context": runtime,
        "sglang.srt.distributed": types.ModuleType("sglang.srt.distributed"),
        pkg: types.ModuleType(pkg),
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, f"{pkg}.all_reduce_utils", load_module(sp / UTILS, f"{pkg}.all_reduce_utils"))
    module = load_module(sp / SYMM, f"{pkg}.torch_symm_mem")
    monkeypatch.setitem(sys.modules, f"{pkg}.torch_symm_mem", module)
    comm = module.TorchSymmMemCommunicator(group=types.SimpleNamespace(group_name="tp"), device=0)
    return comm, calls


@pytest.mark.network
def test_unpatched_0_5_9_communicator_raises_keyerror_12_on_sm120(sp059: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError) as caught:
        symm_mem_with_fake_torch(monkeypatch, sp059, capability=12, world_size=8, multicast_ptr=1)
    assert caught.value.args == (12,)


@pytest.mark.network
def test_patched_communicator_builds_on_sm120_and_picks_multimem_for_8_gpus(
    sp059: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patches.apply(sp059, [PATCH])
    comm, calls = symm_mem_with_fake_torch(monkeypatch, sp059, capability=12, world_size=8, multicast_ptr=1)
    assert comm._WORLD_SIZES_MULTIMEM[12] == [6, 8]
    assert (comm.disabled, comm.max_size) == (False, 128 * MiB)
    comm.all_reduce(FakeTensor())
    assert calls == ["multimem"]


@pytest.mark.network
def test_patched_communicator_uses_two_shot_for_4_gpus(sp059: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patches.apply(sp059, [PATCH])
    comm, calls = symm_mem_with_fake_torch(monkeypatch, sp059, capability=12, world_size=4, multicast_ptr=1)
    comm.all_reduce(FakeTensor())
    assert (comm.max_size, calls) == (64 * MiB, ["two_shot"])


@pytest.mark.network
def test_patched_communicator_still_disables_itself_without_nvlink_multicast(
    sp059: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patches.apply(sp059, [PATCH])
    comm, _ = symm_mem_with_fake_torch(monkeypatch, sp059, capability=12, world_size=8, multicast_ptr=0)
    assert comm.disabled is True  # PCIe cards: the patch removes the crash, not the multicast requirement


# ---------------------------------------------------------------------------------------------- every family


@pytest.mark.network
@pytest.mark.parametrize("version", FAMILY_RELEASES)
def test_each_catalogue_family_round_trips_on_its_real_wheel(tmp_path: Path, version: str) -> None:
    sp = site_packages(tmp_path, ("sglang", version))
    assert {rel: sha(sp / rel) for rel in (UTILS, SYMM)} == hashes(version, "original")
    [applied] = patches.apply(sp, [PATCH])
    assert (applied.action, applied.version) == ("applied", version)
    assert {rel: sha(sp / rel) for rel in (UTILS, SYMM)} == hashes(version, "patched")
    patches.revert(sp, [PATCH])
    for rel in (UTILS, SYMM):
        assert (sp / rel).read_bytes() == wheel_bytes("sglang", version, rel)


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_later_releases_disable_the_communicator_unpatched_and_build_it_patched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    sp = site_packages(tmp_path, ("sglang", version))
    comm, _ = symm_mem_with_fake_torch(monkeypatch, sp, capability=12, world_size=8, multicast_ptr=1)
    assert comm.disabled is True  # .get() lookups: no KeyError, just off
    patches.apply(sp, [PATCH])
    comm, calls = symm_mem_with_fake_torch(monkeypatch, sp, capability=12, world_size=8, multicast_ptr=1)
    comm.all_reduce(FakeTensor())
    assert (comm.disabled, calls) == (False, ["multimem"])


# -------------------------------------------------------------------------------------------------- refusals


def write_dist_info(sp: Path, name: str, version: str) -> None:
    dist_info = sp / f"{name}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_a_release_without_the_communicator_is_refused_as_unsupported(tmp_path: Path) -> None:
    sp = tmp_path / "site-packages"
    write_dist_info(sp, "sglang", "0.5.3")
    [state] = patches.status(sp, [PATCH])
    assert state.state == "unsupported-version"
    assert "no TorchSymmMemCommunicator" in state.reason
    with pytest.raises(PatchRefusedError, match=r"is not supported: this sglang has no TorchSymmMemCommunicator"):
        patches.apply(sp, [PATCH])


@pytest.mark.network
def test_an_unverified_newer_release_is_refused_even_when_its_files_look_known(tmp_path: Path) -> None:
    sp = site_packages(tmp_path, ("sglang", "0.5.23"))
    dist_info = next(sp.glob("sglang-*.dist-info"))
    meta = dist_info / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.5.23", "Version: 0.5.24"))
    [state] = patches.status(sp, [PATCH])
    assert state.state == "unsupported-version"
    assert "match the originals of the '>=0.5.17,<=0.5.23' entry" in state.reason
    with pytest.raises(PatchRefusedError):
        patches.apply(sp, [PATCH])
    assert sha(sp / SYMM) == hashes("0.5.23", "original")[SYMM]


def test_an_env_without_sglang_is_not_installed_and_refused(tmp_path: Path) -> None:
    [state] = patches.status(tmp_path, [PATCH])
    assert state.state == "not-installed"
    assert {f.state for f in state.files} == {"not-installed"}
    with pytest.raises(PatchRefusedError, match="not installed"):
        patches.apply(tmp_path, [PATCH])


def test_an_unknown_patch_id_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown patch nope"):
        patches.status(tmp_path, ["nope"])


def test_known_patch_ids_lists_the_catalogue() -> None:
    assert patch_catalogue.known_patch_ids() == (PATCH,)
