"""Rank functions for tests/torch/test_sharded_state_dict.py: a ShardedOptimizer's whole
``state_dict()`` (consolidate_state_dict, load_state_dict), the path Lightning's and
Hugging Face Trainer's own checkpoints take."""

from __future__ import annotations

from sharded_workers import _forward, _net
from torch_workers import _diff, _same_on_every_rank, _setup


def _reference(torch, batches):
    """One process with a plain Adam over ``batches`` (the global batches)."""
    ref = _net(torch, 2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for x, y in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(_forward(ref, x), y).backward()
        ref_opt.step()
    return ref, ref_opt


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def whole_state(path: str, phase: str, stage: int, steps: int = 3) -> dict:
    """``save``: train ``steps`` steps sharded, then state_dict() without and with
    consolidate_state_dict(); rank 0 saves the whole dict to ``path``. ``resume`` (at
    another N): a new ShardedOptimizer loads it and trains ``steps`` more. Both against
    one process on the global batches."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    gen = torch.Generator().manual_seed(11)
    batches = [(torch.randn(12, 6, generator=gen, dtype=torch.float64),
                torch.randn(12, 3, generator=gen, dtype=torch.float64)) for _ in range(2 * steps)]
    first = 0 if phase == "save" else steps
    model = _net(torch, 2)
    if phase == "resume":  # the weights the saving job ended with
        model.load_state_dict(_reference(torch, batches[:steps])[0].state_dict())
    lr = 0.01 if phase == "save" else 0.5  # resumed: the lr comes from the file
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), stage=stage,
                               named_parameters=model.named_parameters())
    res: dict = {}
    # before any step (accelerate's prepare() moves the state through state_dict and
    # load_state_dict on every rank): the whole, empty state, no collective
    empty = opt.state_dict()
    res["empty"] = (empty["state"] == {} and [len(g["params"]) for g in empty["param_groups"]]
                    == [len(list(model.parameters()))])
    opt.load_state_dict(empty)
    if phase == "resume":
        opt.load_state_dict(torch.load(path, weights_only=True))
        res["lr_loaded"] = opt.param_groups[0]["lr"]
    per = 12 // n
    for x, y in batches[first:first + steps]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(_forward(model, x[per * r:per * r + per]),
                                     y[per * r:per * r + per]).backward()
        opt.step()
    ref, ref_opt = _reference(torch, batches[:first + steps])
    res["diff"] = _diff(torch, model, ref)
    res["same"] = _same_on_every_rank(torch, hvd, model, f"whole.{phase}.{stage}")
    if phase == "resume":
        hvd.shutdown()
        return res
    res["unconsolidated"] = _error(opt.state_dict) if n > 1 else "one rank"
    opt.consolidate_state_dict()
    if r == 0:
        sd = opt.state_dict()
        theirs = ref_opt.state_dict()
        res["keys"] = (sorted(sd["state"]) == sorted(theirs["state"]) and all(
            sorted(sd["state"][k]) == sorted(theirs["state"][k]) for k in theirs["state"]))
        res["state_diff"] = max(float((v - theirs["state"][k][key]).abs().max())
                                for k, st in sd["state"].items() for key, v in st.items())
        torch.save(sd, path)
        # refused: a state of another shape, and another model's groups, naming them
        bad = {"state": {**sd["state"], 0: {**sd["state"][0],
                                            "exp_avg": torch.zeros(2, 2, dtype=torch.float64)}},
               "param_groups": sd["param_groups"]}
        res["bad_shape"] = _error(lambda: opt.load_state_dict(bad))
        fewer = {"state": {}, "param_groups": [{**sd["param_groups"][0],
                                                "params": sd["param_groups"][0]["params"][:-1]}]}
        res["bad_groups"] = _error(lambda: opt.load_state_dict(fewer))
    else:
        res["not_root"] = _error(opt.state_dict)
    hvd.barrier()
    # loaded at the same N into a new optimizer: every rank's pieces get what it held
    again = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.5), stage=stage,
                                 named_parameters=model.named_parameters())
    again.load_state_dict(torch.load(path, weights_only=True))
    old = {name: opt.state[t] for name, _, _, t, _ in opt.shard_layout.shard_pieces()}
    res["reloaded"] = all(
        all(torch.equal(again.state[t][key], old[name][key]) for key in old[name])
        for name, _, _, t, _ in again.shard_layout.shard_pieces())
    res["lr_reloaded"] = again.param_groups[0]["lr"]
    hvd.shutdown()
    return res
