"""The documentation's examples, run as written: each test takes a code block out of README.md or
docs/*.md (found by a line it holds, so an edited example is what runs) and executes it, changing
only what a single machine needs -- addresses of other hosts become a peer on 127.0.0.1, sizes
shrink -- and checks what the text around it promises.

Multi-peer examples run as threads in this process, each peer executing the block; every wait is
bounded and every averager is shut down.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import zgossip

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0


def block(doc: str, holding: str, lang: str = "python") -> str:
    """The one ```lang block of `doc` holding the text `holding`."""
    text = (ROOT / doc).read_text()
    found = [b for b in re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M) if holding in b]
    assert len(found) == 1, f"{doc}: {len(found)} {lang} blocks hold {holding!r}"
    return found[0]


def swap(code: str, old: str, new: str) -> str:
    """`code` with `old` replaced; `old` must be there (else the doc changed and the test would test nothing)."""
    assert old in code, f"the example no longer holds {old!r}"
    return code.replace(old, new)


class Built:
    """Stands in for the `zgossip` module inside an example: records every Averager it builds."""

    def __init__(self, **fixed):
        self.made: list[zgossip.Averager] = []
        self.fixed = fixed

    def module(self) -> types.SimpleNamespace:
        def averager(*args, **kw):
            avg = zgossip.Averager(*args, **{**kw, **self.fixed})
            self.made.append(avg)
            return avg
        return types.SimpleNamespace(**{**{k: getattr(zgossip, k) for k in zgossip.__all__}, "Averager": averager})

    def shutdown(self) -> None:
        for avg in self.made:
            avg.shutdown()


def run_peers(n: int, fn) -> list:
    """fn(i) in n threads; their results, or the first exception raised."""
    out: list = [None] * n
    errors: list = []

    def one(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "an example did not finish"
    if errors:
        raise errors[0]
    return out


def test_readme_using_it_runs_on_two_peers(capsys):
    torch = pytest.importorskip("torch")
    code = block("README.md", "model = torch.nn.Linear(512, 10)")
    code = swap(code, 'listen="tcp://0.0.0.0:0"', 'listen="tcp://127.0.0.1:0"')
    boot = zgossip.Averager([np.zeros(1, np.float32)], prefix="docs-boot", listen="tcp://127.0.0.1:0")
    try:
        code = swap(code, "tcp://10.0.0.5:41000", boot.endpoint)

        def peer(i):
            ns = {"batch_size": 8 * (i + 1), "loss": torch.tensor(float(i))}
            exec(compile(code, "README.md (Using it)", "exec"), ns)
            return ns

        a, b = run_peers(2, peer)
    finally:
        boot.shutdown()
    r = a["result"]
    assert len(r.members) == 2 and set(r.contributors) == set(r.members)
    assert {g["loss"] for g in r.gathered.values()} == {0.0, 1.0}  # what each passed as gather
    assert set(r.timings) >= {"matchmaking", "allreduce", "settle", "apply", "total"}
    for name in ("group_id", "weights", "lost", "complete", "spans", "updated", "bytes_sent", "bytes_received"):
        assert hasattr(r, name), name
    # averaged in place, weighted by batch_size (8 and 16): both models hold the same parameters
    pa, pb = (list(ns["model"].parameters()) for ns in (a, b))
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    with pytest.raises(zgossip.AveragerClosed):  # "Every call on a shut-down averager ... raises"
        a["avg"].step()
    assert "matchmaking" in capsys.readouterr().out


def test_readme_step_control_example_runs_on_two_peers():
    code = block("README.md", "ctl = avg.step(scheduled_time=")
    built = Built(listen="tcp://127.0.0.1:0")
    try:
        a = built.module().Averager([np.zeros(4, np.float32)], prefix="docs-ctl")
        b = built.module().Averager([np.ones(4, np.float32)], prefix="docs-ctl", initial_peers=[a.endpoint])

        def peer(i):
            ns = {"avg": (a, b)[i]}
            exec(compile(code, "README.md (step control)", "exec"), ns)
            return ns["ctl"]

        ctls = run_peers(2, peer)
        for ctl in ctls:
            result = ctl.result(0)
            assert len(result.contributors) == 2 and ctl.stage is zgossip.StepStage.FINISHED
        with a.get_tensors() as (x,):
            np.testing.assert_array_equal(x, np.full(4, 0.5, np.float32))  # weight 64 on both sides
    finally:
        built.shutdown()


def test_readme_compression_examples_build():
    code = block("README.md", 'compression="int8")')
    built = Built(listen="tcp://127.0.0.1:0")
    try:
        tensors = [np.ones(70000, np.float32), np.ones(10, np.float32)]
        exec(compile(code, "README.md (Wire compression)", "exec"), {"zgossip": built.module(), "tensors": tensors})
        assert len(built.made) == 4
    finally:
        built.shutdown()


def _zgossip(*args, cwd):
    """The `zgossip` command in this process (its exit status, what it printed)."""
    from zgossip.cli import main

    out, here = io.StringIO(), Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return main(list(args)), out.getvalue()
    finally:
        os.chdir(here)


def test_readme_keys_commands_and_example(tmp_path):
    """README, "Trust": `zgossip keygen` three times, the allow file by `cat`, and the Python example
    with the peer it names replaced by a live one (its key taken from a.key.pub, as the text says)."""
    shell = block("README.md", "zgossip keygen a.key", lang="bash")
    lines = [ln.split("  #")[0].strip() for ln in shell.splitlines()]
    ids: dict[str, str] = {}
    for ln in lines[:2]:  # keygen a.key; cat ... > allow
        if ln.startswith("zgossip keygen"):
            for key in "abc":
                rc, said = _zgossip("keygen", f"{key}.key", cwd=tmp_path)
                assert rc == 0, said
                ids[key] = re.search(r"peer id: +([0-9a-f]{64})", said).group(1)
        else:
            subprocess.run(ln, shell=True, cwd=tmp_path, check=True, timeout=TIMEOUT)
    assert (tmp_path / "a.key").stat().st_mode & 0o777 == 0o600
    assert len((tmp_path / "allow").read_text().split()) == 3
    assert _zgossip("keygen", "a.key", cwd=tmp_path)[0] == 2  # never overwrites without --force

    code = block("README.md", 'secret_key="a.key"')
    built = Built(listen="tcp://127.0.0.1:0")
    cwd = Path.cwd()
    try:
        os.chdir(tmp_path)
        host = built.module().Averager([np.ones(4, np.float32)], prefix="run", secret_key="a.key", allowed_keys="allow")
        a_pub = (tmp_path / "a.key.pub").read_text().split()[0]
        code = re.sub(r'"tcp://10\.0\.0\.5:41000#[^"]*"', f'"{host.endpoint}#{a_pub}"', code)
        c_pub = (tmp_path / "c.key.pub").read_text().split()[0]
        code = swap(code, "avg.revoke(key)", f"key = {c_pub!r}; avg.revoke(key)")
        ns = {"zgossip": built.module(), "tensors": [np.zeros(4, np.float32)]}
        # the example's peer needs a key of its own on the list: b.key, not the host's
        exec(compile(swap(code, 'secret_key="a.key"', 'secret_key="b.key"'), "README.md (Trust)", "exec"), ns)
        avg = ns["avg"]
        results = run_peers(2, lambda i: (host, avg)[i].step(timeout=10))
        assert all(len(r.contributors) == 2 for r in results)
        assert avg.peer_id == ids["b"]  # a peer's id is its public key (hex), as keygen printed it
    finally:
        os.chdir(cwd)
        built.shutdown()


def test_training_md_diloco_example_runs_alone():
    """docs/training.md, "DiLoCo": the example as written, alone, on a few batches (inner steps only)."""
    torch = pytest.importorskip("torch")
    code = swap(block("docs/training.md", "DiLoCoOptimizer(inner"), "initial_peers=[...]", "initial_peers=[]")
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    ns = {"torch": torch, "model": model, "data": data, "loss_fn": torch.nn.functional.mse_loss}
    try:
        exec(compile(code, "docs/training.md (diloco)", "exec"), ns)
        opt = ns["opt"]
        assert (opt.local_step, opt.steps_in_epoch, opt.local_epoch, opt.inner_steps) == (3, 3, 0, 500)
        assert opt.outer.defaults["nesterov"] and opt.outer.defaults["lr"] == 0.7
    finally:
        if "opt" in ns:
            ns["opt"].shutdown()


def test_training_md_decentralized_and_accumulator_examples_build():
    torch = pytest.importorskip("torch")
    for holding, name in (("DecentralizedAdam(model.parameters()", "opt"), ('Group("foo_group"', "accumulator")):
        code = block("docs/training.md", holding)
        code = code.replace("initial_peers=[...]", "initial_peers=[]")
        ns = {"torch": torch, "model": torch.nn.Linear(4, 2)}
        exec(compile(code, f"docs/training.md ({name})", "exec"), ns)
        obj = ns[name]
        try:
            assert obj.averager.endpoint.startswith("tcp://") if hasattr(obj, "averager") else True
        finally:
            for stop in ("shutdown", "close"):
                if hasattr(obj, stop):
                    getattr(obj, stop)()
                    break


def test_readme_sweep_file_loads_as_the_text_counts(tmp_path):
    """README, "Sweeps": the abridged message_level.toml is a valid sweep file; every combination x seed is
    one run (3 unavailabilities x 2 group sizes x 2 profile mixes x 3 seeds)."""
    from sim.sweep import load_sweep

    code = block("README.md", 'kind = "scenario"', lang="toml")
    # its `scenario` is relative to the sweep file: the same layout as the shipped sweeps, in tmp_path
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "sweeps").mkdir()
    for f in (ROOT / "sim" / "scenarios").glob("flaky_home.*"):
        (tmp_path / "scenarios" / f.name).write_bytes(f.read_bytes())
    path = tmp_path / "sweeps" / "message_level.toml"
    path.write_text(code)
    sweep = load_sweep(path)
    runs = sweep.runs()
    assert len(runs) == 3 * 2 * 2 * 3


@pytest.mark.parametrize("make", [lambda: np.arange(3), lambda: np.zeros(3, np.complex64), lambda: np.ones(3, bool),
                                  "torch.int16"])
def test_readme_tensor_dtypes_other_than_float16_32_64_bfloat16_raise_type_error(make):
    """README, "Using it": "Tensors must be float16, float32, float64 or torch's bfloat16 (others
    raise TypeError ...)"."""
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(3, dtype=torch.int16) if make == "torch.int16" else make()
    with pytest.raises(TypeError):
        zgossip.Averager([tensor], prefix="docs-dtype", listen="tcp://127.0.0.1:0").shutdown()
    for t in [np.zeros(3, dt) for dt in (np.float16, np.float32, np.float64)] + [torch.zeros(3, dtype=torch.bfloat16)]:
        zgossip.Averager([t], prefix="docs-dtype", listen="tcp://127.0.0.1:0").shutdown()


def test_readme_error_classes_exist_and_derive_from_zgossip_error():
    """README, "Using it": "Errors all derive from `zgossip.ZGossipError`: ..." -- every class that bullet
    names is exported by zgossip and is one; a download with no donor raises the one it names."""
    text = (ROOT / "README.md").read_text()
    bullet = text[text.index("- Errors all derive from `zgossip.ZGossipError`"):]
    bullet = bullet[:bullet.index("\n- ")]
    names = set(re.findall(r"`([A-Z][A-Za-z]+)`", bullet))
    assert {"GroupNotFound", "RoundTimeout", "PeerLost", "StateUnavailable", "AveragerClosed"} <= names
    for name in names:
        assert issubclass(getattr(zgossip, name), zgossip.ZGossipError), name
    with zgossip.Averager([np.zeros(3, np.float32)], prefix="docs-state", listen="tcp://127.0.0.1:0") as avg:
        with pytest.raises(zgossip.StateUnavailable, match="0 tried"):
            avg.load_state_from_peers(timeout=1)


def test_training_md_collaborative_examples_run_alone(capsys):
    """docs/training.md: the CollaborativeOptimizer example's loop (one peer, a few batches short of the
    global batch: it accumulates) and the overlapped-averaging constructor."""
    torch = pytest.importorskip("torch")
    first = block("docs/training.md", "from zgossip.collaborative import CollaborativeOptimizer")
    first = swap(first, 'initial_peers=["tcp://10.0.0.5:41000"]', "initial_peers=[]")
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(32, 4), torch.randint(0, 2, (32,))) for _ in range(3)]
    ns = {"torch": torch, "model": model, "data": data, "loss_fn": torch.nn.functional.cross_entropy}
    exec(compile(first, "docs/training.md (collaborative)", "exec"), ns)
    try:
        assert ns["opt"].local_epoch == 0 and ns["opt"].global_progress.samples_accumulated == 96
        assert capsys.readouterr().out.startswith("0 GlobalProgress(")
    finally:
        ns["opt"].shutdown()
    overlapped = block("docs/training.md", "delay_optimizer_step=True, delay_grad_averaging=True")
    exec(compile(overlapped, "docs/training.md (overlapped)", "exec"), ns)
    try:
        assert ns["opt"].delay_grad_averaging
    finally:
        ns["opt"].shutdown()


def test_training_md_checkpoint_example_round_trips_a_wrapper(tmp_path):
    """docs/training.md, "Checkpoints": the example, run as written (save, then load into a wrapper built
    as before), brings back the parameters, Adam's state and the epoch."""
    torch = pytest.importorskip("torch")
    from zgossip.optim import DecentralizedAdam

    code = swap(block("docs/training.md", 'torch.save({"model": model.state_dict(), "opt": opt.state_dict()}'),
                '"ckpt.pt"', repr(str(tmp_path / "ckpt.pt")))
    saving, loading = code.split("# ... later")
    model = torch.nn.Linear(4, 2)
    opt = DecentralizedAdam(model.parameters(), prefix="docs-ckpt", steps_per_epoch=1, average_every=None,
                            average_period=3600.0)
    fresh_model = torch.nn.Linear(4, 2)
    fresh = DecentralizedAdam(fresh_model.parameters(), prefix="docs-ckpt-2", steps_per_epoch=1,
                              average_every=None, average_period=3600.0)
    try:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        exec(compile(saving, "docs/training.md (checkpoint: save)", "exec"), {"torch": torch, "model": model,
                                                                             "opt": opt})
        exec(compile("# ... later" + loading, "docs/training.md (checkpoint: load)", "exec"),
             {"torch": torch, "model": fresh_model, "opt": fresh})
        assert fresh.local_epoch == opt.local_epoch == 3 and fresh.local_step == 3
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
        assert torch.equal(fresh.opt.state[fresh.params[0]]["exp_avg"], opt.opt.state[opt.params[0]]["exp_avg"])
    finally:
        opt.shutdown()
        fresh.shutdown()
