"""The build backend of gormm_rmm (PEP 517), kept in the project so that pip needs nothing else.

It builds a wheel of the pure-Python package plus librmm_go.so, which it builds from the Go
module around this directory with `go build -buildmode=c-shared ./cmd/rmm-python`. Where Go (or
cgo's C and C++ compilers) is missing, or the Go module is not found, the wheel holds the package alone
and the build says so on stderr (`pip install -v` shows it): set GORMM_RMM_LIBRARY to a prebuilt
librmm_go.so then. GORMM_RMM_REQUIRE_LIBRARY=1 makes that case an error instead, and
GORMM_RMM_SOURCE names the Go module's directory where it is not an ancestor of this one.

It writes the wheel itself (a zip with the dist-info files) rather than through setuptools, whose
bdist_wheel needs the wheel package that an offline machine may lack.
"""
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the Python project's directory
PACKAGE = "gormm_rmm"
LIBRARY = "librmm_go.so"
GO_MODULE = "github.com/gormm/rmm"


def _project():
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        text = f.read().decode("utf-8")
    try:
        import tomllib
        p = tomllib.loads(text)["project"]
        return p["name"], p["version"], p.get("description", ""), p.get("requires-python", "")
    except ImportError:  # Python before 3.11: the few keys read by hand
        def key(k):
            m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(k), text, re.M)
            return m.group(1) if m else ""
        return key("name"), key("version"), key("description"), key("requires-python")


def _dist_name(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _log(msg):
    sys.stderr.write("gormm_rmm build: %s\n" % msg)
    sys.stderr.flush()


def _go_module_root():
    d = os.environ.get("GORMM_RMM_SOURCE") or HERE
    d = os.path.abspath(d)
    while True:
        gomod = os.path.join(d, "go.mod")
        if os.path.isfile(gomod):
            with open(gomod) as f:
                first = f.readline().split()
            if first[:2] == ["module", GO_MODULE]:
                return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _build_library(outdir):
    """Builds librmm_go.so into outdir; returns its path, or None with the reason on stderr."""
    why = None
    root = _go_module_root()
    go = shutil.which("go")
    if root is None:
        why = "the Go module %s is not around %s (set GORMM_RMM_SOURCE to its directory)" % (GO_MODULE, HERE)
    elif go is None:
        why = "go is not on the PATH"
    else:
        out = os.path.join(outdir, LIBRARY)
        env = dict(os.environ, CGO_ENABLED="1")
        cmd = [go, "build", "-buildmode=c-shared", "-o", out, "./cmd/rmm-python"]
        _log("%s (in %s)" % (" ".join(cmd), root))
        r = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if r.returncode == 0 and os.path.isfile(out):
            return out
        why = "go build failed:\n%s" % r.stdout.decode("utf-8", "replace")[-4000:]
    if os.environ.get("GORMM_RMM_REQUIRE_LIBRARY") == "1":
        raise RuntimeError("gormm_rmm: cannot build %s: %s" % (LIBRARY, why))
    _log("WARNING: installing without %s: %s\nSet GORMM_RMM_LIBRARY to a librmm_go.so built with "
         "`go build -buildmode=c-shared -o librmm_go.so ./cmd/rmm-python` in the Go repository." % (LIBRARY, why))
    return None


def _package_files():
    """(path in the wheel, path on disk) of the package's Python files."""
    out = []
    for d, dirs, files in os.walk(os.path.join(HERE, PACKAGE)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out.append((os.path.relpath(p, HERE).replace(os.sep, "/"), p))
    return out


def _metadata(name, version, description, requires_python):
    lines = ["Metadata-Version: 2.1", "Name: %s" % name, "Version: %s" % version]
    if description:
        lines.append("Summary: %s" % description)
    if requires_python:
        lines.append("Requires-Python: %s" % requires_python)
    return "\n".join(lines) + "\n"


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def _platform_tag():
    return re.sub(r"[-.]", "_", sysconfig.get_platform())


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, version, description, requires_python = _project()
    dist = _dist_name(name)
    with tempfile.TemporaryDirectory() as tmp:
        lib = _build_library(tmp)
        tag = "py3-none-" + (_platform_tag() if lib else "any")
        files = [(arc, open(p, "rb").read()) for arc, p in _package_files()]
        if lib:
            with open(lib, "rb") as f:
                files.append(("%s/%s" % (PACKAGE, LIBRARY), f.read()))
    info = "%s-%s.dist-info" % (dist, version)
    files.append(("%s/METADATA" % info, _metadata(name, version, description, requires_python).encode()))
    files.append(("%s/WHEEL" % info, ("Wheel-Version: 1.0\nGenerator: gormm_build\nRoot-Is-Purelib: %s\nTag: %s\n"
                                       % ("false" if lib else "true", tag)).encode()))
    files.append(("%s/top_level.txt" % info, (PACKAGE + "\n").encode()))
    record = [_record_line(arc, data) for arc, data in files] + ["%s/RECORD,," % info]
    files.append(("%s/RECORD" % info, ("\n".join(record) + "\n").encode()))
    wheel = "%s-%s-%s.whl" % (dist, version, tag)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return wheel


def build_sdist(sdist_directory, config_settings=None):
    """The Python project alone: a wheel built from it has the library only where
    GORMM_RMM_SOURCE names the Go module."""
    name, version, description, requires_python = _project()
    base = "%s-%s" % (_dist_name(name), version)
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for rel in ["pyproject.toml", "README.md", "build_backend/gormm_build.py"] + [a for a, _ in _package_files()]:
            p = os.path.join(HERE, rel)
            if os.path.isfile(p):
                t.add(p, arcname="%s/%s" % (base, rel))
        data = _metadata(name, version, description, requires_python).encode()
        ti = tarfile.TarInfo("%s/PKG-INFO" % base)
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    return os.path.basename(path)
