"""Token-level distillation across tokenizers (specjax/train/crossvocab.py): where a draft with
its own tokenizer and the target cut the text at the same byte, the draft learns the target's
next-token distribution over the tokens it can propose.

Two byte-level BPEs are trained here on the same small text, one with fewer merges, so the
draft's cuts refine the target's at most places but not all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from conftest import tiny_config

import specjax as sj
from specjax.draft.vocab import token_keys
from specjax.train import crossvocab
from specjax.train.loop import TrainConfig, fit

TEXT = ["def add(x, y):\n    return x + y\n", "class Point:\n    def __init__(self, x):\n"
        "        self.x = x\n", "for item in items:\n    print(item, end='')\n",
        "# caf\u00e9 na\u00efve\n", "while value < limit:\n    value = value * 2\n"] * 8


def bpe(vocab_size, text=TEXT):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    return sj.Tokenizer(tok, None, (0,))


@pytest.fixture(scope="module")
def pair():
    target_tok, draft_tok = bpe(330), bpe(290)
    documents = ["".join(TEXT[:20]), "".join(TEXT[20:])]
    stream = np.concatenate([target_tok.encode(t, add_special_tokens=False) + [0]
                             for t in documents]).astype(np.int32)
    return target_tok, draft_tok, stream


_KEYS = {}


def written(tokenizer, ids):
    keys = _KEYS.setdefault(id(tokenizer), token_keys(tokenizer))
    return b"".join(keys[int(i)][1] for i in ids)


def test_windows_align_where_both_cut_the_text(pair):
    """Draft position i is aligned with target position j exactly when the draft's first i + 1
    tokens and the target's first j + 1 write the same bytes (j before the window's last token,
    whose next token lies outside it); windows with the end-of-text token, or cut inside "é",
    are skipped."""
    target_tok, draft_tok, stream = pair
    aligner = crossvocab.Aligner(target_tok, draft_tok, np.arange(1, draft_tok.vocab_size))
    seen = aligned = unaligned = cut = 0
    for start in range(0, len(stream) - 24, 7):
        ids = stream[start:start + 24]
        got = aligner.window(ids, 60)
        if 0 in ids:
            assert got is None
            continue
        if got is None:  # only a window cut inside a character
            with pytest.raises(UnicodeDecodeError):
                written(target_tok, ids).decode("utf-8")
            cut += 1
            continue
        draft, align = got
        n = int((draft != 0).sum())
        assert n < 61 and written(draft_tok, draft[:n]) == written(target_tok, ids)
        ends = {len(written(target_tok, ids[:j + 1])): j for j in range(len(ids) - 1)}
        for i in range(n - 1):
            j = ends.get(len(written(draft_tok, draft[:i + 1])), -1)
            assert align[i] == j, (start, i)
            aligned += j >= 0
            unaligned += j < 0
        assert (align[max(n - 1, 0):] == -1).all()
        seen += 1
    assert seen > 20 and aligned > unaligned > 0 and cut > 0, (seen, aligned, unaligned, cut)


def test_a_stream_without_usable_windows_is_named(pair):
    """A stream whose every window spans an end of text looped for ever; one shorter than a
    window failed in numpy ("high <= 0")."""
    target_tok, draft_tok, stream = pair
    aligner = crossvocab.Aligner(target_tok, draft_tok, np.arange(1, draft_tok.vocab_size))
    assert aligner.batch(stream, 2, 24, 16, 0, 0)["target"].shape == (2, 24)
    with pytest.raises(ValueError, match="200 windows of 24 tokens drawn, 0 usable"):
        aligner.batch(np.zeros(1000, np.int32), 2, 24, 16, 0, 0)
    with pytest.raises(ValueError, match="holds no window of 24 target tokens"):
        aligner.batch(stream[:20], 2, 24, 16, 0, 0)


def test_spelled_windows_read_each_target_token_as_its_spelling(pair):
    """With the chain's spelling table the draft reads each target token as its spelling (not
    the window's text re-cut by its tokenizer), so every target position but the last aligns:
    with the last draft token of its spelling. Rows [n, L] give windows from their starts."""
    from specjax.draft.vocab import token_pairs, token_spellings
    target_tok, _, stream = pair
    # merges learnt on other text: its cuts do not always refine the target's
    draft_tok = bpe(290, TEXT + ["self.value = items + limit\n"] * 20)
    shared = np.array(sorted(set(token_pairs(draft_tok, target_tok)[:, 0].tolist()) - {0}))
    spelling = np.asarray(token_spellings(draft_tok, target_tok, target_tok.vocab_size))
    aligner = crossvocab.Aligner(target_tok, draft_tok, shared, spelling)
    recut = crossvocab.Aligner(target_tok, draft_tok, shared)
    differs = 0
    ok = [s for s in range(0, len(stream) - 24, 5) if 0 not in stream[s:s + 24]]
    for start in ok:
        ids = stream[start:start + 24]
        draft, align = aligner.window(ids, 80)
        pieces = [row[row >= 0] for row in spelling[ids]]
        n = sum(len(x) for x in pieces)
        assert (draft[:n] == np.concatenate(pieces)).all() and (draft[n:] == 0).all()
        ends = np.cumsum([len(x) for x in pieces]) - 1
        want = np.full(80, -1)
        want[ends[:-1]] = np.arange(len(ids) - 1)
        assert (align == want).all(), start
        other = recut.window(ids, 80)
        differs += other is not None and not np.array_equal(other[0], draft)
    assert differs > 0  # the two readings are not the same here
    rows = np.stack([stream[s:s + 30] for s in ok[:6]])
    batch = aligner.batch(rows, 5, 24, 80, 3, 1)
    assert all(any((b == r[:24]).all() for r in rows) for b in batch["target"])
    # each row's draft and alignment are what ``window`` makes of its target tokens
    for target, draft, align in zip(batch["target"], batch["draft"], batch["align"]):
        want_draft, want_align = aligner.window(target, 80)
        np.testing.assert_array_equal(draft, want_draft)
        np.testing.assert_array_equal(align, want_align)


def same_model_pair(pair):
    target_tok, _, stream = pair
    model = sj.init_model(tiny_config(vocab_size=target_tok.vocab_size, hidden_size=32,
                                      max_pos=64), jax.random.key(0), init_std=0.5)
    aligner = crossvocab.Aligner(target_tok, target_tok, np.arange(target_tok.vocab_size))
    batch = aligner.batch(stream, 12, 24, 30, 0, 0)
    # the rows whose text the tokenizer encodes back into the same tokens (a window's first
    # token can encode differently on its own), so both models read the same context
    same = (batch["draft"][:, :24] == batch["target"]).all(1)
    assert same.sum() >= 4
    return model, aligner, {k: v[same][:4] for k, v in batch.items()}


def test_a_draft_that_is_the_target_is_always_accepted(pair):
    """The target as its own draft, same tokenizer: every position aligns and the estimate is 1
    at every temperature; read one position off (a wrong alignment) and it is not."""
    model, aligner, batch = same_model_pair(pair)
    got = crossvocab.expected_acceptance(model, model, aligner, batch)
    assert got["positions"] == 4 * 23
    for key in ("t1", "t0.8", "greedy"):
        assert got[key] == pytest.approx(1.0, abs=1e-5), got
    shifted = dict(batch, align=np.where(batch["align"] > 0, batch["align"] - 1, -1))
    wrong = crossvocab.expected_acceptance(model, model, aligner, shifted)
    assert wrong["t1"] < 0.9 and wrong["greedy"] < 0.9, wrong


def test_the_soft_labels_are_the_targets_distribution_over_the_draft_vocabulary(pair):
    """At the target's own weights the objective (without the next-token term) is at its
    minimum: its gradient vanishes; at other weights it does not, and a few steps of ``fit`` on
    ``batches(step)`` lower it, resuming to the same weights."""
    model, aligner, batch = same_model_pair(pair)
    aux = (model.params, jnp.asarray(aligner.draft_ids), jnp.asarray(aligner.target_of))
    objective = crossvocab.SoftLabelObjective(model.config, model.config, ce_weight=0.0)
    batch = jax.tree.map(jnp.asarray, batch)
    norm = lambda g: float(jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(g))))  # noqa
    assert norm(jax.grad(objective)(model.params, batch, aux)) < 1e-4
    other = sj.init_model(model.config, jax.random.key(1), init_std=0.5)
    assert norm(jax.grad(objective)(other.params, batch, aux)) > 1e-2


def test_fit_on_aligned_batches_lowers_the_objective_and_resumes(pair, tmp_path):
    model, aligner, _ = same_model_pair(pair)
    target_tok, _, stream = pair
    other = sj.init_model(model.config, jax.random.key(1), init_std=0.5)
    aux = (model.params, jnp.asarray(aligner.draft_ids), jnp.asarray(aligner.target_of))
    objective = crossvocab.SoftLabelObjective(model.config, model.config, ce_weight=0.1)
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=24, learning_rate=1e-2, warmup_steps=1,
                      checkpoint_every=2, eval_every=100)

    def batches(step):
        return aligner.batch(stream, 4, 24, 30, 3, step)

    held = jax.tree.map(jnp.asarray, aligner.batch(stream, 4, 24, 30, 99, 0))
    before = float(objective(other.params, held, aux))
    run = {"objective": "test"}
    straight, _ = fit(objective, other.params, aux, None, cfg, tmp_path / "a", run,
                      progress=False, batches=batches)
    assert float(objective(straight, held, aux)) < before - 0.1
    def counted(seen):  # batches, recording the steps asked for
        return lambda step: seen.append(step) or batches(step)
    first, then = [], []
    fit(objective, other.params, aux, None, cfg, tmp_path / "b", run, progress=False,
        batches=counted(first), max_seconds=0)
    resumed, _ = fit(objective, other.params, aux, None, cfg, tmp_path / "b", run,
                     progress=False, batches=counted(then))
    # one step, then the rest from where it stopped (a fit that ignored the checkpoint would
    # give the same weights, starting again from step 0)
    assert first == [0] and then == [1, 2, 3, 4, 5]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_draft_vocabulary_the_target_cannot_write_is_refused(pair):
    target_tok, _, _ = pair
    own = bpe(300)
    import json
    spec = json.loads(own.backend.to_str())
    spec["model"]["vocab"]["zzqq"] = len(spec["model"]["vocab"])
    odd = sj.Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), None, (0,))
    with pytest.raises(ValueError, match="no target token"):
        crossvocab.Aligner(target_tok, odd, np.asarray([1, 2, odd.vocab_size - 1]))


def test_the_targets_own_text_is_generated_once_and_resumed(tmp_path, monkeypatch):
    """The soft stage's generated windows: chunks of the target's continuations (prompt +
    continuation, rows of one length; even chunks greedy, so a row is the target's argmax
    path), written one file a chunk; a second call with the time already spent generates
    nothing and returns the same rows."""
    from conftest import tiny_model

    from specjax.train import pair
    monkeypatch.setattr(pair, "KD_BATCH", 3)
    model = tiny_model(max_pos=32)
    stream = np.arange(200, dtype=np.int32) % 16
    rows = pair._generated_text(tmp_path, model, stream, minutes=1e-9)
    n = min(pair.KD_PROMPT, 32 // 4)
    assert rows.shape == (3, 32) and len(list(tmp_path.glob("chunk-*.npy"))) == 1
    logits = sj.model.logits(model, jnp.asarray(rows[:, :-1]))
    assert (np.asarray(jnp.argmax(logits, -1))[:, n - 1:] == rows[:, n:]).all()
    again = pair._generated_text(tmp_path, None, stream, minutes=1e-9)  # no target needed
    assert np.array_equal(again, rows)


def test_long_rows_fill_the_context_from_each_prompt_length(tmp_path, monkeypatch):
    """``long_rows``: chunk i's prompt cycles through the given lengths two chunks at a time (a
    greedy and a sampled chunk each), and every row, prompt plus the target's text, is the whole
    context long; a greedy chunk's continuation is the target's argmax path from its
    prompt's end."""
    from conftest import tiny_model

    from specjax.train import pair
    lengths = pair.long_rows(32, prompts=(4, 12))
    assert [lengths(i) for i in range(5)] == [(4, 28), (4, 28), (12, 20), (12, 20), (4, 28)]
    monkeypatch.setattr(pair, "KD_BATCH", 2)
    model = tiny_model(max_pos=32)
    stream = np.arange(300, dtype=np.int32) % 16
    for i in (0, 2):  # the greedy chunks of each prompt length
        rows, _ = pair._continuations(model, stream, i, lengths(i))
        n = lengths(i)[0]
        assert rows.shape == (2, 32)
        logits = sj.model.logits(model, jnp.asarray(rows[:, :-1]))
        assert (np.asarray(jnp.argmax(logits, -1))[:, n - 1:] == rows[:, n:]).all()
