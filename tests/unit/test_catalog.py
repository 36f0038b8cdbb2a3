"""Catalog, pulling and model resolution. Pulls run against fake wheels built here, except one real
pull of smollm2-135m through the session fixture."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from folio.loaders import catalog, wheels
from folio.loaders.catalog import (
    CATALOG,
    CatalogEntry,
    ModelSourceError,
    folio_home,
    list_pulled,
    pull,
    resolve_model,
)
from folio.loaders.wheels import WheelFile


def make_gguf(path: Path) -> bytes:
    """A small but valid GGUF: llama metadata and one f32 tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def make_wheel(path: Path, files: dict[str, bytes], tamper: str | None = None) -> Path:
    """A wheel holding `files` and a RECORD of their sha256; `tamper` names a member whose RECORD
    hash is made wrong, as if the member were altered after the wheel was built."""
    dist_info = f"{path.name.split('-')[0]}-1.0.dist-info"
    rows = []
    for name, data in files.items():
        digest = hashlib.sha256(data + (b"x" if name == tamper else b"")).digest()
        rows.append(f"{name},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(data)}")
    rows.append(f"{dist_info}/RECORD,,")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(rows) + "\n")
    return path


class FakeIndex:
    """Stands in for `pip download`: serves prebuilt wheels by requirement and counts the calls."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheels: dict[str, Path] = {}
        self.calls: list[str] = []
        self.fail_on: str | None = None

    def add(self, package: str, files: dict[str, bytes], tamper: str | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        wheel_name = f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
        self.wheels[package] = make_wheel(self.root / wheel_name, files, tamper)

    def download(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        package = requirement.split("==")[0]
        if package == self.fail_on:
            raise KeyboardInterrupt  # the user pressing Ctrl-C mid-pull
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheels[package], dest))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("FOLIO_HOME", str(root))
    return root


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    fake = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(wheels, "download_wheel", fake.download)
    return fake


@pytest.fixture
def model_bytes(tmp_path: Path) -> bytes:
    return make_gguf(tmp_path / "source.gguf")


def add_split_model(
    index: FakeIndex, monkeypatch: pytest.MonkeyPatch, data: bytes, sha256: str | None, with_sums: bool = False
) -> CatalogEntry:
    """Register 'tiny' in the catalog: `data` split over two wheels, optionally with a SHA256SUMS wheel."""
    cut = len(data) // 2
    index.add("tiny-part1", {"tiny_part1/data/tiny.gguf.part00": data[:cut]})
    index.add("tiny-part2", {"tiny_part2/data/tiny.gguf.part01": data[cut:]})
    checksums = None
    if with_sums:
        index.add("tiny-sums", {"tiny_sums/SHA256SUMS": f"{hashlib.sha256(data).hexdigest()}  tiny.gguf\n".encode()})
        checksums = WheelFile("tiny-sums", "tiny_sums/SHA256SUMS")
    entry = CatalogEntry(
        name="tiny",
        description="test model",
        file_name="tiny.gguf",
        parts=(
            WheelFile("tiny-part1", "tiny_part1/data/tiny.gguf.part00", "1.0"),
            WheelFile("tiny-part2", "tiny_part2/data/tiny.gguf.part01", "1.0"),
        ),
        checksums=checksums,
        sha256=sha256,
    )
    monkeypatch.setitem(CATALOG, "tiny", entry)
    return entry


def visible_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- folio_home and resolution ---------------------------------------------------------------------


def test_folio_home_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FOLIO_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert folio_home() == tmp_path / ".cache" / "folio"
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "elsewhere"))
    assert folio_home() == tmp_path / "elsewhere"


def test_unknown_name_lists_known_models(home: Path) -> None:
    for call in (pull, resolve_model):
        with pytest.raises(ModelSourceError) as info:
            call("no-such-model")
        message = str(info.value)
        assert "no-such-model" in message and "\n" not in message
        assert all(name in message for name in CATALOG)


def test_resolve_local_gguf_file(tmp_path: Path, model_bytes: bytes) -> None:
    path = tmp_path / "source.gguf"
    assert resolve_model(path) == path
    assert resolve_model(str(path)) == path


def test_resolve_rejects_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no such file"):
        resolve_model(tmp_path / "missing.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ModelSourceError, match="not a .gguf file"):
        resolve_model(other)


def test_resolve_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(folder)
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder


def test_resolve_catalog_name_pulls_on_demand(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, hashlib.sha256(model_bytes).hexdigest())
    path = resolve_model("tiny")
    assert path == home / "models" / "tiny" / "tiny.gguf"
    assert path.read_bytes() == model_bytes


# -- pulling ---------------------------------------------------------------------------------------


def test_pull_assembles_verifies_and_writes_manifest(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hashlib.sha256(model_bytes).hexdigest()
    add_split_model(index, monkeypatch, model_bytes, sha)
    path = pull("tiny")
    assert path.read_bytes() == model_bytes
    assert visible_files(path.parent) == ["manifest.json", "tiny.gguf"]  # no temp files left over
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["sha256"] == sha and manifest["size_bytes"] == len(model_bytes)
    assert manifest["architecture"] == "llama" and manifest["quantization"] == "ALL_F32"
    assert [s["package"] for s in manifest["sources"]] == ["tiny-part1", "tiny-part2"]

    (model,) = list_pulled()
    assert (model.name, model.path, model.size_bytes) == ("tiny", path, len(model_bytes))
    assert (model.architecture, model.quantization) == ("llama", "ALL_F32")

    calls = len(index.calls)
    assert pull("tiny") == path
    assert len(index.calls) == calls  # already pulled: no download


def test_pull_uses_the_declared_checksum(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, sha256=None, with_sums=True)
    assert pull("tiny").read_bytes() == model_bytes
    assert index.calls[0] == "tiny-sums"


def test_declared_checksum_must_agree_with_catalog(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, sha256="0" * 64, with_sums=True)
    with pytest.raises(ModelSourceError, match="declares sha256 .* but the catalog records 0000"):
        pull("tiny")
    assert "tiny.gguf" not in visible_files(home / "models" / "tiny")


def test_sha_mismatch_leaves_nothing_that_looks_pulled(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, sha256="f" * 64)
    with pytest.raises(ModelSourceError) as info:
        pull("tiny")
    got = hashlib.sha256(model_bytes).hexdigest()
    assert f"expected {'f' * 64}, got {got}" in str(info.value)
    assert visible_files(home / "models" / "tiny") == []
    assert list_pulled() == []


def test_corrupt_gguf_is_detected(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    truncated = model_bytes[: len(model_bytes) - 100]  # the tensor data runs past the end
    add_split_model(index, monkeypatch, truncated, sha256=None)
    with pytest.raises(ModelSourceError, match="not a valid GGUF file"):
        pull("tiny")
    assert visible_files(home / "models" / "tiny") == []


def test_tampered_wheel_member_is_detected(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, sha256=None)
    cut = len(model_bytes) // 2
    index.add(
        "tiny-part2", {"tiny_part2/data/tiny.gguf.part01": model_bytes[cut:]}, tamper="tiny_part2/data/tiny.gguf.part01"
    )
    with pytest.raises(ModelSourceError, match="RECORD"):
        pull("tiny")


def test_interrupted_pull_is_retried_cleanly(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, hashlib.sha256(model_bytes).hexdigest())
    index.fail_on = "tiny-part2"
    with pytest.raises(KeyboardInterrupt):
        pull("tiny")
    assert visible_files(home / "models" / "tiny") == []  # the partial file went with its temp folder
    assert list_pulled() == []
    index.fail_on = None
    assert pull("tiny").read_bytes() == model_bytes


def test_file_without_manifest_or_with_wrong_size_is_not_pulled(
    home: Path, index: FakeIndex, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_split_model(index, monkeypatch, model_bytes, hashlib.sha256(model_bytes).hexdigest())
    path = pull("tiny")
    # A crash between renaming the file and writing the manifest:
    (path.parent / "manifest.json").unlink()
    assert list_pulled() == []
    calls = len(index.calls)
    assert pull("tiny") == path and len(index.calls) > calls
    # A file cut short after the pull:
    path.write_bytes(model_bytes[:10])
    assert list_pulled() == []
    assert pull("tiny").read_bytes() == model_bytes


def test_pip_failure_names_the_package_and_pip_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:5] == ["-m", "pip", "install", "--dry-run"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
        stderr = (
            "ERROR: Could not find a version that satisfies the requirement nope==1.0\n"
            "ERROR: No matching distribution found for nope==1.0\n"
        )
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    with pytest.raises(ModelSourceError) as info:
        wheels.download_wheel("nope==1.0", tmp_path / "dl")
    assert str(info.value) == "pip download nope==1.0 failed: ERROR: No matching distribution found for nope==1.0"


@pytest.mark.parametrize("tampered", [False, True])
def test_the_wheel_pip_finds_is_fetched_and_checked_against_the_index_sha256(tmp_path, monkeypatch, tampered):
    wheel = tmp_path / "index" / "llm_tiny-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_tiny/model.gguf", b"GGUF" * 1000)
    sha256 = hashlib.sha256(wheel.read_bytes()).hexdigest()
    report = {"install": [{"download_info": {"url": wheel.as_uri(), "archive_info": {"hashes": {
        "sha256": "0" * 64 if tampered else sha256}}}}]}  # fmt: skip

    def pip_report(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[3:5] == ["install", "--dry-run"] and "--report" in cmd and cmd[-1] == "llm-tiny==1.0"
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(report), stderr="")

    monkeypatch.setattr(wheels.subprocess, "run", pip_report)
    if tampered:
        with pytest.raises(ModelSourceError, match="does not match the sha256 its index gave"):
            wheels.download_wheel("llm-tiny==1.0", tmp_path / "dl")
        assert not list((tmp_path / "dl").iterdir())  # nothing unverified is left behind
    else:
        fetched = wheels.download_wheel("llm-tiny==1.0", tmp_path / "dl")
        assert fetched == tmp_path / "dl" / wheel.name and fetched.read_bytes() == wheel.read_bytes()


def test_catalog_entries_point_at_gguf_files() -> None:
    for entry in CATALOG.values():
        assert entry.file_name.endswith(".gguf") and entry.parts
        assert all(part.version for part in entry.parts)  # pinned, so the bytes cannot change
    gemma = CATALOG["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.checksums is not None


# -- the real thing --------------------------------------------------------------------------------


def test_real_pull_of_smollm2(smollm2_gguf: Path) -> None:
    assert smollm2_gguf == catalog.model_dir("smollm2-135m") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("smollm2-135m") == smollm2_gguf
    (model,) = [m for m in list_pulled() if m.name == "smollm2-135m"]
    assert (model.architecture, model.quantization) == ("llama", "Q4_1")
    assert model.size_bytes == smollm2_gguf.stat().st_size
    manifest = json.loads((smollm2_gguf.parent / "manifest.json").read_text())
    assert manifest["sha256"] == CATALOG["smollm2-135m"].sha256
