"""Benchmark supersession: the update judge on synthetic updates, on phrasing families it was or was not fitted on,
and on real pairs.

1. **Synthetic updates.** A corpus of `memprune synth --updates P` conversations (generated in memory) knows, per
bullet, its persona fact (slot) and whether the slot got a new value in a later session than the bullet's own
(the bullet is then *stale*: an old value). The scorer's encoder embeds every bullet once (cached); then, for each
lower edge of the band, the decision's supersession step (`MemoryPruner`, scope = conversation, subject =
speaker, judge `slot`) marks bullets `superseded`.

- candidates: where recall can be lost before the judge: stale bullets with a later bullet of their slot's new
  value at all, with one in the band, and the cosine of those true pairs
- pairs: the judge on the candidate pairs of the band (an update: A stale, B another value of the same slot)
- precision = stale superseded / superseded; recall = stale bullets superseded / stale bullets (every earlier
  mention of an old value counts); false supersession = unchanged (current-value) bullets superseded / unchanged
- newest kept: per updated slot, under a token budget per session, the slot's kept bullets all state its newest
  value and one is kept, with supersession vs the same decision without it; unconditionally (over all updated
  slots) and conditional on the decision keeping the slot at all (any of its bullets)
- misses: the stale bullets the decision with supersession still keeps, by where they were lost (no true pair
  in the band, the judge said no, the judge said yes) and whether another old mention of the slot was superseded

2. **Phrasing families** (`memprune.synth.families`, `--families N` conversations per split and seed; parts 2 and 3
are `bench/lifecycle_families.py`): the same
decision on the *fit* families (other conversations than any fitted on) and, separately, on the *held-out*
families (verbs, kinds and the first person never fitted on): recall by kind and by the forms of the stale
bullet and its update (attribute or event), false supersession of unchanged facts by kind, and the share of
facts followed by a compatible related fact (a distractor: "visited Oslo" after "lives in Bergen") that were
superseded.

3. **Real pairs** (`bench/real_updates.py`: pairs of the LoCoMo development subset and MSC valid labelled by hand
as update, distractor or unchanged, read from `--shared`): how many of each the judge calls an update, and how
many lie in the band at all.

`--judge llm --llm CONFIG` measures the `llm` update judge instead (an LLM config YAML, configs/llm/; a GPU
engine for a corpus of useful size): the same tables, plus the pairs without a verdict (answers that never
parsed, counted as no update). `--lows` narrows the band sweep (each low is one more pass of the judge);
`--conversations 0` skips part 1, `--families 0` part 2, `--no-real` part 3.

`--fit` first fits the `slot` judge's network (one hidden layer, torch) on the candidate pairs of a seed-0 corpus
(`--fit-conversations`, 300; seed 0 is never a measured seed), chooses its threshold on the next third as many
seed-0 conversations (the selection pairs, in the swept band: the lowest threshold whose pair precision there is
>= 0.97, recall first), and writes the judge's weights (`memprune/decision/updates/slot.safetensors`), which the
measurement then reads. `--select` only chooses the threshold again, the same way, for the weights as they are
(no refit; give the `--fit-conversations` they were fitted with, so that the selection conversations are the
same held-back ones).

    python bench/lifecycle_bench.py --conversations 120 --updates 0.3 --seed 1 2 [--fit]
    python bench/lifecycle_bench.py --select --fit-conversations 900 --conversations 120 --seed 1 2
    python bench/lifecycle_bench.py --judge llm --llm configs/llm/vllm-gpu.yaml --conversations 120 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOWS = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
FIT_SEED = 0
SELECT_PRECISION = 0.97  # the slot judge's threshold: the lowest keeping this pair precision (held-back seed 0)


class Cached:
    """The scorer with each text embedded once per run (the decisions below re-embed the same corpus)."""

    def __init__(self, scorer: Any) -> None:
        self.scorer, self.cache = scorer, {}

    def embed(self, texts: list[str], batch_size: int = 128) -> np.ndarray:
        new = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if new:
            self.cache.update(zip(new, self.scorer.embed(new, batch_size=batch_size)))
        return np.array([self.cache[t] for t in texts], dtype=np.float32)

    def score_embeddings(self, emb: np.ndarray) -> np.ndarray:
        return self.scorer.score_embeddings(emb)


def corpus(conversations: int, updates: float, seed: int,
           first: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Bullets as mappings (the columns the decision reads) and per-bullet ground truth, of the conversations
    numbered first, first + 1, ..."""
    from memprune.synth.config import SynthSettings
    from memprune.synth.generator import synth_conversation

    settings = SynthSettings(conversations=first + conversations, updates=updates, seed=seed)
    rows, slot, stale, newest, value = [], [], [], [], []
    for i in range(first, first + conversations):
        conv = synth_conversation(i, settings)
        times = {s.session_index: s.time for s in conv.sessions}
        upd = {b.slot: b.session_index for b in conv.bullets if b.update_of is not None}
        for b in conv.bullets:
            rows.append({"bullet_id": b.bullet_id, "text": b.text, "speaker": b.speaker,
                         "conversation_id": conv.conversation_id, "session_index": b.session_index,
                         "time": times[b.session_index]})
            slot.append(None if b.slot is None else (conv.conversation_id, b.slot))
            stale.append(b.slot in upd and b.session_index < upd[b.slot])
            newest.append(b.slot in upd and b.session_index >= upd[b.slot])
            value.append(b.key)
    return rows, {"slot": slot, "stale": np.array(stale), "newest": np.array(newest), "value": value}


def pairs_of(rows: list[dict[str, Any]], truth: dict[str, Any], emb: np.ndarray, low: float, high: float) -> Any:
    """The step's candidate pairs (every bullet a representative, none pinned) and whether each is an update (the
    same slot, A stale, B another value)."""
    from memprune.decision import Bullets, PruneRule
    from memprune.decision.supersede import candidates
    from memprune.prune.inputs import Lives

    rule = PruneRule.of(supersede={"judge": "slot"})
    bullets = Bullets.of(np.zeros(len(rows)), texts=[r["text"] for r in rows], embeddings=emb,
                         **Lives().of_mappings(rows, rule))
    a, b, c = candidates(bullets, (low, high), None, np.zeros(len(rows), dtype=bool))
    slot, stale, value = truth["slot"], truth["stale"], truth["value"]
    y = np.array([slot[i] is not None and slot[i] == slot[j] and stale[i] and value[i] != value[j]
                  for i, j in zip(a, b)], dtype=bool)
    return a, b, c, y


def judge_pairs(rows: list[dict[str, Any]], a: np.ndarray, b: np.ndarray, c: np.ndarray, emb: np.ndarray,
                encode: Any) -> Any:
    from memprune.decision.updates import Pairs

    return Pairs([rows[i]["text"] for i in a], [rows[j]["text"] for j in b], c, encode, emb[a], emb[b])


def threshold_pairs(data: Any, encode: Any, high: float) -> tuple[np.ndarray, np.ndarray]:
    """The slot judge's features of the candidate pairs of `data` (rows, truth, embeddings) in the swept band
    [min(LOWS), high), and whether each is an update."""
    from memprune.decision.updates.slot import features

    rows, truth, emb = data
    a, b, c, y = pairs_of(rows, truth, emb, min(LOWS), high)
    return features(judge_pairs(rows, a, b, c, emb, encode)), y


def choose_threshold(p: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, dict[str, float]]]:
    """The lowest threshold (of 0.01, 0.02, ... 0.99) whose pair precision on the selection pairs is at least
    `SELECT_PRECISION` (recall first: a stale fact kept is the miss that counts; the best F1 if none is), and the
    precision, recall and F1 at each."""
    table = {}
    for t in np.arange(1, 100) / 100:
        said = p >= t
        tp = float((said & y).sum())
        table[f"{t:.2f}"] = {"precision": tp / max(int(said.sum()), 1), "recall": tp / max(int(y.sum()), 1),
                             "f1": 2 * tp / max(int(said.sum() + y.sum()), 1)}
    ok = [t for t, v in table.items() if v["precision"] >= SELECT_PRECISION]
    best = min(ok, key=float) if ok else max(table, key=lambda t: table[t]["f1"])
    return float(best), table


def select(held_out: Any, encode: Any, high: float, path: Path, w: dict[str, np.ndarray] | None = None,
           meta: dict[str, str] | None = None) -> dict[str, Any]:
    """Choose the slot judge's threshold on `held_out` (seed-0 conversations it was not fitted on) and write the
    weights `w` (default: the file at `path`, its network unchanged) with it to `path`."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from memprune.decision.updates.slot import update_probability

    if w is None:
        with safe_open(str(path), "np") as f:
            w, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    xh, yh = threshold_pairs(held_out, encode, high)
    threshold, table = choose_threshold(update_probability(xh, w), yh)
    print(f"select: held-out pair precision / recall by threshold "
          f"{json.dumps({t: [round(v['precision'], 4), round(v['recall'], 4)] for t, v in table.items()})}")
    rule = (f"the lowest with held-out pair precision >= {SELECT_PRECISION}"
            if table[f"{threshold:.2f}"]["precision"] >= SELECT_PRECISION else "the best held-out pair F1 (none "
            f"reaches precision {SELECT_PRECISION})")
    meta = {**(meta or {}), "threshold": f"{threshold:.2f}: {rule} on {len(yh)} pairs in [{min(LOWS):g}, {high:g}) "
            "of other seed-0 conversations"}
    save_file({**{k: v for k, v in w.items() if k != "threshold"},
               "threshold": np.array([threshold], dtype=np.float32)}, str(path), metadata=meta)
    return {"path": str(path), "threshold": threshold, "held_out_pairs": int(len(yh)),
            "held_out_updates": int(yh.sum()), "held_out": table[f"{threshold:.2f}"]}


def fit(data: Any, held_out: Any, encode: Any, high: float, path: Path, hidden: int = 128, dropout: float = 0.5,
        epochs: int = 15) -> dict[str, Any]:
    """Fit the slot judge's network on the candidate pairs of `data` (rows, truth, embeddings of seed 0), choose its
    threshold on `held_out` (other seed-0 conversations; `select`) and write its weights to `path`."""
    import torch

    x, y = threshold_pairs(data, encode, high)
    mean, scale = x.mean(0), np.maximum(x.std(0), 1e-6)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Dropout(dropout), torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    xt, yt = torch.tensor((x - mean) / scale, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    for epoch in range(epochs):
        perm, total = torch.randperm(len(xt)), 0.0
        for k in range(0, len(xt), 256):
            i = perm[k:k + 256]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xt[i])[:, 0], yt[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(i)
        print(f"fit: epoch {epoch + 1}/{epochs} loss {total / len(xt):.4f}", flush=True)
    w = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    w = {"mean": mean, "scale": scale.astype(np.float32), "w1": w["1.weight"], "b1": w["1.bias"],
         "w2": w["3.weight"][0], "b2": w["3.bias"]}
    meta = {"fitted_on": f"memprune synth --updates, seed {FIT_SEED}", "pairs": str(len(y)),
            "updates": str(int(y.sum())), "hidden": str(hidden), "dropout": str(dropout), "epochs": str(epochs)}
    return {"pairs": int(len(y)), "updates": int(y.sum()), "hidden": hidden, "dropout": dropout, "epochs": epochs,
            **select(held_out, encode, high, path, w, meta)}


def measure(pruner_for: Any, rows: list[dict[str, Any]], truth: dict[str, Any], low: float) -> dict[str, Any]:
    _, d = pruner_for(low).decisions(rows, groups=[(r["conversation_id"], r["session_index"]) for r in rows])
    sup = d.superseded_by >= 0
    stale = truth["stale"]
    unchanged = ~stale
    tp = int((sup & stale).sum())
    return {"low": low, "superseded": int(sup.sum()), "stale": int(stale.sum()), "true": tp,
            "precision": tp / sup.sum() if sup.any() else 1.0, "recall": tp / stale.sum() if stale.any() else 1.0,
            "false_supersession_pct": 100.0 * (sup & unchanged).sum() / unchanged.sum()}


def newest_kept(keep: np.ndarray, truth: dict[str, Any]) -> dict[str, float]:
    """Over updated slots: kept at all (any bullet), newest kept (the kept bullets all state the newest value and
    one is kept), and newest kept among the slots kept at all."""
    slots: dict[Any, list[int]] = {}
    for i, s in enumerate(truth["slot"]):
        if s is not None and (truth["stale"][i] or truth["newest"][i]):
            slots.setdefault(s, []).append(i)
    kept = np.array([any(keep[i] for i in idx) for idx in slots.values()])
    ok = np.array([any(keep[i] for i in idx if truth["newest"][i])
                   and not any(keep[i] for i in idx if truth["stale"][i]) for idx in slots.values()])
    return {"slots": len(ok), "slot_kept": float(kept.mean()), "newest_kept": float(ok.mean()),
            "newest_kept_if_slot_kept": float(ok[kept].mean()) if kept.any() else 1.0}


def misses(d: Any, truth: dict[str, Any], paired: np.ndarray, judged: np.ndarray) -> dict[str, int]:
    """Where the misses of newest kept (with supersession) come from: stale bullets kept, by whether a true pair
    (a later bullet of the slot's new value) was in the band, whether the judge accepted one (then the step or the
    policy lost it), and whether another old mention of the slot was superseded (a restatement left behind)."""
    kept = truth["stale"] & d.keep
    in_band, said = np.zeros(len(kept), bool), np.zeros(len(kept), bool)
    in_band[paired], said[judged] = True, True
    gone = {truth["slot"][i] for i in np.flatnonzero(truth["stale"] & (d.superseded_by >= 0))}
    return {"stale_kept": int(kept.sum()), "no_true_pair_in_band": int((kept & ~in_band).sum()),
            "judge_said_no": int((kept & in_band & ~said).sum()), "judge_said_yes": int((kept & said).sum()),
            "another_old_mention_superseded": sum(truth["slot"][i] in gone for i in np.flatnonzero(kept))}


def candidate_counts(a: np.ndarray, b: np.ndarray, c: np.ndarray, y: np.ndarray, truth: dict[str, Any],
                     band: tuple[float, float]) -> dict[str, Any]:
    """Where recall is lost before the judge: stale bullets with a true partner (a later bullet of the slot's new
    value) at all, with one in the band; the true pairs by cosine."""
    stale = truth["stale"]
    partner, in_band = np.zeros(len(stale), bool), np.zeros(len(stale), bool)
    partner[a[y]] = True
    in_band[a[y & (c >= band[0]) & (c < band[1])]] = True
    edges = [-1.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, band[1], 1.01]
    return {"stale": int(stale.sum()), "stale_with_new_value_later": int(partner[stale].sum()),
            "stale_with_new_value_in_band": int(in_band[stale].sum()), "true_pairs": int(y.sum()),
            "true_pairs_by_cosine": {f"[{lo:g}, {hi:g})": int((y & (c >= lo) & (c < hi)).sum())
                                     for lo, hi in zip(edges, edges[1:])}}


def run_seed(seed: int, args: argparse.Namespace, scorer: Any, high: float) -> dict[str, Any]:
    from memprune.decision.supersede import Supersede
    from memprune.decision.updates import update_judge
    from memprune.prune import MemoryPruner, score_and_embed

    t0 = time.perf_counter()
    rows, truth = corpus(args.conversations, args.updates, seed)
    _, emb = score_and_embed(scorer, [r["text"] for r in rows], 128)
    out: dict[str, Any] = {"seed": seed, "judge": args.judge, "bullets": len(rows)}
    a, b, c, y = pairs_of(rows, truth, emb, -1.0, 1.01)  # every time-ordered same-subject pair
    out["candidates"] = candidate_counts(a, b, c, y, truth, (min(LOWS), high))
    band = (c >= min(LOWS)) & (c < high)
    a, b, c, y = a[band], b[band], c[band], y[band]
    judge = args.supersede
    said = np.asarray(update_judge(args.judge).judge(judge_pairs(rows, a, b, c, emb, scorer.embed), Supersede(**judge)))
    verdict = said > 0
    tp = int((verdict & y).sum())
    out["pairs"] = {"candidates": int(len(y)), "updates": int(y.sum()), "judged_updates": int(verdict.sum()),
                    "no_verdict": int((said < 0).sum()),
                    "precision": tp / max(int(verdict.sum()), 1), "recall": tp / max(int(y.sum()), 1)}

    def pruner(low: float) -> MemoryPruner:
        return MemoryPruner(scorer, supersede={**judge, "low": low}, min_keep=0, threshold=0.0)

    out["band"] = [measure(pruner, rows, truth, low) for low in args.lows]
    groups = [(r["conversation_id"], r["session_index"]) for r in rows]
    out["newest_kept"] = {"budget_tokens_per_session": args.budget}
    for name, on in (("with", True), ("without", False)):
        p = MemoryPruner(scorer, supersede=judge if on else {}, budget_tokens=args.budget,
                         tokenizer="whitespace")
        d = p.decisions(rows, groups)[1]
        out["newest_kept"][name] = newest_kept(d.keep, truth)
        if on:
            out["newest_kept"]["misses"] = misses(d, truth, a[y], a[y & verdict])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def markdown(r: dict[str, Any], high: float) -> str:
    cand, pr, nk = r["candidates"], r["pairs"], r["newest_kept"]
    lines = [f"### seed {r['seed']}, judge {r['judge']} ({r['bullets']} bullets, {r['seconds']} s)", "",
             f"stale bullets {cand['stale']}: with a later new value of their slot "
             f"{cand['stale_with_new_value_later']}, "
             f"with one in the band [{min(LOWS)}, {high}) {cand['stale_with_new_value_in_band']}; true pairs by cosine "
             + ", ".join(f"{k} {v}" for k, v in cand["true_pairs_by_cosine"].items()), "",
             f"candidate pairs in the band: {pr['candidates']}, updates {pr['updates']}; judge precision "
             f"{pr['precision']:.3f}, recall {pr['recall']:.3f}, without a verdict {pr['no_verdict']}", "",
             "| band low (high %g) | superseded | precision | recall | false supersession |" % high,
             "|---|---|---|---|---|"]
    lines += [f"| {b['low']:.1f} | {b['superseded']} | {b['precision']:.3f} | {b['recall']:.3f} | "
              f"{b['false_supersession_pct']:.2f}% |" for b in r["band"]]
    lines += ["", f"| budget {nk['budget_tokens_per_session']} tokens/session | slot kept at all | newest kept | "
              "newest kept, slot kept |", "|---|---|---|---|"]
    lines += [f"| {name} supersession | {nk[name]['slot_kept']:.3f} | {nk[name]['newest_kept']:.3f} | "
              f"{nk[name]['newest_kept_if_slot_kept']:.3f} |" for name in ("with", "without")]
    lines += ["", "misses with supersession (stale bullets kept): " + ", ".join(
        f"{k.replace('_', ' ')} {v}" for k, v in nk["misses"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    from lifecycle_families import family_markdown, real_markdown, run_families, run_real

    from memprune.config import validate
    from memprune.decision.supersede import Supersede
    from memprune.decision.updates import UPDATE_JUDGES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=120)
    ap.add_argument("--updates", type=float, default=0.3)
    ap.add_argument("--seed", type=int, nargs="+", default=[1], help="the corpora measured (not 0: --fit's)")
    ap.add_argument("--judge", choices=sorted(UPDATE_JUDGES), default="slot", help="the update judge measured")
    ap.add_argument("--llm", default=None, help="--judge llm: the LLM config YAML (configs/llm/)")
    ap.add_argument("--lows", type=float, nargs="+", default=LOWS, help="the band's lower edges swept")
    ap.add_argument("--fit", action="store_true", help="fit the slot judge on seed 0 first and write its weights")
    ap.add_argument("--select", action="store_true",
                    help="choose the shipped slot judge's threshold again on the held-back seed-0 conversations "
                         "(those after --fit-conversations; no refit) and write it into its weights")
    ap.add_argument("--fit-conversations", type=int, default=300,
                    help="the size of --fit's seed-0 corpus (a third as many more select the threshold)")
    ap.add_argument("--families", type=int, default=150,
                    help="conversations per split of the phrasing-family set measured per seed (0: none)")
    ap.add_argument("--low", type=float, default=None,
                    help="the band's lower edge for the family set and the real pairs (default: the rule's)")
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the judge on the real pairs labelled in ../shared (bench/data/real_updates.json)")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="the shared data folder (real pairs)")
    ap.add_argument("--budget", type=int, default=40, help="tokens per session for the newest-kept comparison")
    ap.add_argument("--scorer", default=None, help="a scorer artifact (default: an untrained all-MiniLM-L6-v2 head)")
    ap.add_argument("--out", default="runs/bench-lifecycle")
    args = ap.parse_args()
    args.supersede = {"judge": args.judge, **({"llm_config": args.llm} if args.llm else {})}
    if args.low is None:
        args.low = Supersede.model_fields["low"].default
    try:
        validate(Supersede, args.supersede, "--judge/--llm")
    except ValueError as exc:
        ap.error(str(exc))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from memprune.decision import DEDUP_THRESHOLD
    from memprune.decision.updates import slot
    from memprune.prune import score_and_embed
    from memprune.scorer import Scorer, ScorerConfig

    if args.scorer:
        base = Scorer.load(args.scorer)
    else:
        from memprune.encoders import minilm_path

        base = Scorer.build(ScorerConfig(encoder=minilm_path()), seed=0)
    scorer = Cached(base)
    result: dict[str, Any] = {"encoder": base.config.encoder, "conversations": args.conversations,
                              "updates": args.updates}
    if args.fit or args.select:
        data = []
        for first, n in ((0, args.fit_conversations), (args.fit_conversations, args.fit_conversations // 3))[
                0 if args.fit else 1:]:
            rows, truth = corpus(n, args.updates, FIT_SEED, first)
            data.append((rows, truth, score_and_embed(scorer, [r["text"] for r in rows], 128)[1]))
        if args.fit:
            result["fitted"] = fit(*data, scorer.embed, DEDUP_THRESHOLD, slot.WEIGHTS)
        else:
            result["selected"] = select(data[0], scorer.embed, DEDUP_THRESHOLD, slot.WEIGHTS)
        print(f"seed {FIT_SEED}: {json.dumps(result.get('fitted', result.get('selected')))}", flush=True)
    result["seeds"], result["families"], text = [], [], []
    for seed in args.seed:
        if args.conversations:
            result["seeds"].append(run_seed(seed, args, scorer, DEDUP_THRESHOLD))
            text.append(markdown(result["seeds"][-1], DEDUP_THRESHOLD))
            print(text[-1], flush=True)
        for split in ("fit", "held") if args.families else ():
            result["families"].append(run_families(split, seed, args, scorer))
            text.append(family_markdown(result["families"][-1]))
            print(text[-1], flush=True)
    if args.real:
        result["real"] = run_real(args, scorer, DEDUP_THRESHOLD)
        text.append(real_markdown(result["real"]))
        print(text[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lifecycle_bench.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    (out / "lifecycle_bench.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
