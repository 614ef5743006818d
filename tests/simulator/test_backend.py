"""Backend selection on `import nkilib` (nkilib/_backend.py, docs/simulator.md#backend-selection).

Each scenario runs in a fresh interpreter (subprocess) with its own PYTHONPATH and environment,
so the `nki` modules of this test process are never disturbed.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Prints one JSON line describing what `import nkilib` did; log lines go to stderr.
_PROBE = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
    import nkilib
    import importlib
    names = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.typing", "nki.compiler",
             "nki.dtype", "nki.tensor")
    mods = {n: getattr(importlib.import_module(n), "__name__", "?") for n in names}
    print("RESULT " + json.dumps({"backend": nkilib.BACKEND, "modules": mods}))
""")

_GENUINE_LOOKING_NKI = {
    "nki/__init__.py": "def jit(f=None, **k):\n    return f\nFAKE_GENUINE = True\n",
    "nki/language/__init__.py": "def ndarray(*a, **k):\n    pass\n",
    "nki/isa/__init__.py": "def nc_matmul(*a, **k):\n    pass\ndef nc_matmul_mx(*a, **k):\n    pass\n",
    "nki/isa/constants.py": "", "nki/typing.py": "", "nki/compiler.py": "", "nki/dtype.py": "", "nki/tensor.py": "",
}


def _write_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def _run(tmp_path, env_extra=None, files=None, script=_PROBE):
    """Run `script` in a fresh interpreter with tmp_path first on PYTHONPATH; returns the CompletedProcess."""
    _write_tree(str(tmp_path), files or {})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NKILIB_", "NKI_", "NEURON_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), REPO])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path))


def _result(proc):
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len("RESULT "):])


def _backend_log_lines(proc):
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("LOG nkilib") and "backend" in ln]


def test_import_installs_simulator_when_nki_missing(tmp_path):
    proc = _run(tmp_path)
    res = _result(proc)
    assert res["backend"] == "simulator"
    sim = "nkilib.simulator.nki"
    assert res["modules"] == {
        "nki": sim,
        "nki.language": sim + ".language",
        "nki.isa": sim + ".isa",
        "nki.isa.constants": sim + ".isa.constants",
        "nki.typing": sim + ".typing",
        "nki.compiler": sim + ".compiler",
        "nki.dtype": sim + ".language.dtypes",
        "nki.tensor": sim + ".tensor",
    }
    logs = _backend_log_lines(proc)
    assert len(logs) == 1, proc.stderr
    assert "simulator" in logs[0]


def test_in_process_backend_is_simulator():
    import nki
    import nki.isa as nisa
    import nki.language as nl

    import nkilib

    assert nkilib.BACKEND == "simulator"
    assert nki.__name__ == "nkilib.simulator.nki"
    assert nl.ndarray.__module__.startswith("nkilib.simulator")
    assert sys.modules["nki.isa"] is nisa


def test_forbidden_simulator_raises_import_error_naming_missing_nki(tmp_path):
    proc = _run(tmp_path, {"NKILIB_SIMULATOR": "0"})
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "NKILIB_SIMULATOR=0" in proc.stderr
    assert "No module named 'nki'" in proc.stderr


def test_placeholder_nki_package_falls_back_to_simulator(tmp_path):
    files = {"nki/__init__.py": "raise ImportError('WRONG PACKAGE: this is a placeholder')\n"}
    proc = _run(tmp_path, files=files)
    res = _result(proc)
    assert res["backend"] == "simulator"
    assert res["modules"]["nki"] == "nkilib.simulator.nki"
    logs = _backend_log_lines(proc)
    assert len(logs) == 1, proc.stderr
    assert "simulator" in logs[0] and "WRONG PACKAGE" in logs[0]


def test_placeholder_nki_with_simulator_forbidden_names_the_problem(tmp_path):
    files = {"nki/__init__.py": "raise RuntimeError('WRONG PACKAGE')\n"}
    proc = _run(tmp_path, {"NKILIB_SIMULATOR": "0"}, files=files)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "WRONG PACKAGE" in proc.stderr


def test_incomplete_nki_is_not_genuine(tmp_path):
    files = {"nki/__init__.py": "def jit(f):\n    return f\n", "nki/language/__init__.py": "",
             "nki/isa/__init__.py": "def nc_matmul(*a):\n    pass\n"}
    proc = _run(tmp_path, {"NKILIB_SIMULATOR": "0"}, files=files)
    assert proc.returncode != 0
    assert "not genuine" in proc.stderr and "nc_matmul_mx" in proc.stderr and "ndarray" in proc.stderr
    res = _result(_run(tmp_path, files=files))
    assert res["backend"] == "simulator"


def test_genuine_looking_nki_is_used_unless_simulator_forced(tmp_path):
    show_fake = 'import nki; print("FAKE", getattr(nki, "FAKE_GENUINE", False)); print("RESULT "'
    script = _PROBE.replace('print("RESULT "', show_fake)
    proc = _run(tmp_path, files=_GENUINE_LOOKING_NKI, script=script)
    res = _result(proc)
    assert res["backend"] == "neuron"
    assert "FAKE True" in proc.stdout
    logs = _backend_log_lines(proc)
    assert len(logs) == 1 and "Neuron nki" in logs[0], proc.stderr

    forced = _run(tmp_path, {"NKILIB_SIMULATOR": "1"}, files=_GENUINE_LOOKING_NKI, script=script)
    res = _result(forced)
    assert res["backend"] == "simulator"
    assert res["modules"]["nki"] == "nkilib.simulator.nki"
    assert "FAKE False" in forced.stdout
    logs = _backend_log_lines(forced)
    assert len(logs) == 1 and "forced by NKILIB_SIMULATOR=1" in logs[0], forced.stderr


def test_forced_simulator_without_nki(tmp_path):
    res = _result(_run(tmp_path, {"NKILIB_SIMULATOR": "1"}))
    assert res["backend"] == "simulator"


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_invalid_nkilib_simulator_value_rejected(tmp_path, value):
    proc = _run(tmp_path, {"NKILIB_SIMULATOR": value})
    assert proc.returncode != 0
    assert "NKILIB_SIMULATOR must be" in proc.stderr and repr(value) in proc.stderr


def test_reimport_logs_once(tmp_path):
    script = _PROBE.replace("import nkilib\n", "import nkilib\nimport importlib\nimportlib.reload(nkilib)\n")
    proc = _run(tmp_path, script=script)
    assert _result(proc)["backend"] == "simulator"
    assert len(_backend_log_lines(proc)) == 1, proc.stderr
