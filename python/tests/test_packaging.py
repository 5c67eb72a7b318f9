"""One version everywhere, the Cargo workspace's ([workspace.package] in Cargo.toml): the
installed package's ``__version__`` and metadata, tmsctl, the wheel and the sdist. Also what the
wheel and the sdist must hold to be published (the license, the whole workspace). No torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

import torch_memory_saver as tms_pkg

ROOT = Path(__file__).resolve().parents[2]


def load_toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(text)


@pytest.fixture(scope="module")
def cargo_toml() -> dict:
    path = ROOT / "Cargo.toml"
    if not path.is_file():
        pytest.skip("needs the source tree's Cargo.toml")
    return load_toml(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cargo_version(cargo_toml) -> str:
    return cargo_toml["workspace"]["package"]["version"]


def installed() -> metadata.Distribution:
    """The installed distribution, if the package imported is the one it installed (a source tree
    on sys.path may hold a build's egg-info, which describes no installed files)."""
    try:
        dist = metadata.distribution("torch_memory_saver")
    except metadata.PackageNotFoundError:
        pytest.skip("needs the installed package (scripts/test installs its wheel)")
    init = Path(tms_pkg.__file__).resolve()
    if not any(Path(dist.locate_file(f)).resolve() == init for f in dist.files or ()):
        pytest.skip("the package imported is not the one installed (scripts/test installs its wheel)")
    return dist


def test_installed_version_is_the_cargo_version(cargo_version):
    dist = installed()
    assert tms_pkg.__version__ == dist.version
    assert Version(tms_pkg.__version__) == Version(cargo_version)


def test_installed_tmsctl_reports_the_cargo_version(cargo_version):
    dist = installed()
    tmsctl = [dist.locate_file(f) for f in dist.files or () if f.name == "tmsctl"]
    assert tmsctl, "the distribution installs tmsctl"
    out = subprocess.run([str(tmsctl[0]), "--version"], capture_output=True, text=True, timeout=30, check=True)
    words = out.stdout.split()
    assert words[:2] == ["tmsctl", cargo_version], out.stdout
    assert "Rust implementation; commit" in out.stdout, out.stdout


@pytest.mark.skipif(not os.environ.get("TMS_TEST_WHEEL"), reason="TMS_TEST_WHEEL names the wheel to check")
def test_wheel_metadata(cargo_version):
    z = zipfile.ZipFile(os.environ["TMS_TEST_WHEEL"])
    info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = HeaderParser().parsestr(z.read(f"{info}/METADATA").decode())
    assert meta["Name"] == "torch_memory_saver"
    assert Version(meta["Version"]) == Version(cargo_version)
    assert info == f"torch_memory_saver-{meta['Version']}.dist-info"
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE", "THIRD-PARTY-LICENSES"]
    license_text = z.read(f"{info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    if (ROOT / "LICENSE").is_file():
        assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    # The binaries link MIT/ISC/BSL crates statically, whose notices must go with every copy.
    third = z.read(f"{info}/licenses/THIRD-PARTY-LICENSES").decode()
    for crate in ("nix", "tracing", "sharded-slab", "libloading", "xxhash-rust", "clap"):
        assert f"\n{crate} " in third, crate
    if (ROOT / "THIRD-PARTY-LICENSES").is_file():
        assert third == (ROOT / "THIRD-PARTY-LICENSES").read_text(encoding="utf-8")
    assert meta["Requires-Python"] == ">=3.9"
    classifiers = meta.get_all("Classifier")
    for c in ("Environment :: GPU :: NVIDIA CUDA :: 12", "Environment :: GPU :: NVIDIA CUDA :: 13",
              "Operating System :: POSIX :: Linux"):
        assert c in classifiers


@pytest.mark.skipif(not os.environ.get("TMS_TEST_WHEEL"), reason="TMS_TEST_WHEEL names the wheel to check")
def test_wheel_binaries_name_no_path_of_the_build_machine():
    """The wheel's binaries name no folder of the machine that built them: not the builder's
    home (cargo keeps the dependencies' sources there, and their panic messages name their
    files), not cargo's home, not the checkout. The wheel is built here (scripts/test)."""
    home = os.path.expanduser("~").rstrip("/")
    cargo_home = os.environ.get("CARGO_HOME") or os.path.join(home, ".cargo")
    needles = {cargo_home.rstrip("/").encode(), str(ROOT).encode()}
    if len(home) > 1:
        needles.add(home.encode() + b"/")
    z = zipfile.ZipFile(os.environ["TMS_TEST_WHEEL"])
    leaks = {}
    for name in z.namelist():
        if name.endswith(".so") or name.endswith("/tmsctl"):
            data = z.read(name)
            found = sorted(n.decode() for n in needles if n in data)
            if found:
                leaks[name] = found
    assert not leaks, leaks


@pytest.mark.skipif(not os.environ.get("TMS_TEST_SDIST"), reason="TMS_TEST_SDIST names the sdist to check")
def test_sdist_holds_the_workspace(cargo_toml, cargo_version):
    with tarfile.open(os.environ["TMS_TEST_SDIST"]) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        files = {n[len(top) + 1:] for n in names if n.startswith(top + "/")}
        pkg_info = HeaderParser().parsestr(tar.extractfile(f"{top}/PKG-INFO").read().decode())
        sdist_cargo = load_toml(tar.extractfile(f"{top}/Cargo.toml").read().decode())
    assert top == f"torch_memory_saver-{pkg_info['Version']}"
    assert Version(pkg_info["Version"]) == Version(cargo_version)
    assert sdist_cargo["workspace"]["package"]["version"] == cargo_version
    needed = {"Cargo.toml", "Cargo.lock", "LICENSE", "THIRD-PARTY-LICENSES", "README.md", "pyproject.toml", "setup.py",
              "python/torch_memory_saver/__init__.py", "python/torch_memory_saver/py.typed"}
    needed |= {f"{member}/Cargo.toml" for member in cargo_toml["workspace"]["members"]}
    assert needed <= files, sorted(needed - files)
    for member in cargo_toml["workspace"]["members"]:
        assert any(f.startswith(f"{member}/src/") and f.endswith(".rs") for f in files), member
    stray = [f for f in files if f.split("/")[0] in ("target", "dist", "build", ".upstream", ".git")
             or f.endswith((".so", ".whl", ".pyc"))]
    assert not stray, stray


@pytest.mark.skipif(not os.environ.get("TMS_TEST_SDIST"), reason="TMS_TEST_SDIST names the sdist to check")
def test_sdist_holds_only_what_git_tracks():
    """MANIFEST.in grafts whole folders: scripts/wheel builds the sdist from a copy of the files
    git tracks, so that no untracked file lying in the checkout (a local note, a key) ships.
    Besides them, only what setuptools writes (PKG-INFO, setup.cfg, the egg-info)."""
    root = Path(__file__).resolve().parents[2]
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True)
    tracked = set(tracked.stdout.decode().split("\0")) - {""}
    with tarfile.open(os.environ["TMS_TEST_SDIST"]) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    top = names[0].split("/")[0]
    files = {n[len(top) + 1:] for n in names}
    made = {"PKG-INFO", "setup.cfg"}
    untracked = sorted(f for f in files - tracked - made if not f.startswith("python/torch_memory_saver.egg-info/"))
    assert not untracked, untracked


def test_third_party_licenses_name_every_linked_crate():
    """THIRD-PARTY-LICENSES (shipped in the wheel and the sdist) holds the notices of exactly
    the crates that Cargo.lock links into libtms.so and tmsctl: scripts/third-party-licenses
    rewrites it after a dependency changes."""
    import shutil

    script = ROOT / "scripts" / "third-party-licenses"
    if not script.is_file() or shutil.which("cargo") is None:
        pytest.skip("needs the repository's scripts/ and cargo")
    probe = subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked", "--offline"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"cargo metadata (offline: needs the crates a build fetched): {probe.stderr.strip()}")
    r = subprocess.run([sys.executable, str(script), "--check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_relative_links_in_the_readme_and_docs_lead_somewhere():
    """Every relative link of README.md and docs/*.md names a file of the repository (the
    sdist holds them all), and every link to a heading of the README names one."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5, pages
    import re

    def anchors(page: Path) -> set:
        heads = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in heads}

    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def _rust_version(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))[:2]


def test_the_stated_rust_toolchain_builds_every_locked_crate(cargo_toml):
    """Cargo.toml's rust-version, the toolchain README.md says a build needs, is no older than
    the rust-version of any locked crate that the build or the tests compile on this machine
    (cargo refuses a rustc older than any of them: "libloading@0.9.1 requires rustc 1.88.0").
    The loom model checker's crates (built only with --cfg loom) are scripts/test's own."""
    import json
    import re
    import shutil

    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("needs cargo")
    host = re.search(r"^host: (\S+)$", subprocess.run(["rustc", "-vV"], capture_output=True, text=True,
                                                      check=True).stdout, re.M).group(1)
    out = subprocess.run(
        [cargo, "metadata", "--format-version", "1", "--locked", "--offline", "--filter-platform", host],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        pytest.skip(f"cargo metadata (offline: needs the crates a build fetched): {out.stderr.strip()}")
    meta = json.loads(out.stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    seen, todo = set(), list(meta["workspace_members"])
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(d["pkg"] for d in nodes[i]["deps"])
    floor = cargo_toml["workspace"]["package"]["rust-version"]
    newer = sorted(f"{packages[i]['name']}@{packages[i]['version']} requires {packages[i]['rust_version']}"
                   for i in seen if packages[i].get("rust_version")
                   and _rust_version(packages[i]["rust_version"]) > _rust_version(floor))
    assert not newer, f"rust-version {floor}: {newer}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"With a Rust toolchain ({floor} or newer" in readme
