"""Tree drafts: topology tables, the tree acceptance rule (exact enumeration), greedy equality,
end-to-end distributions, and the committed cache."""

import itertools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, release_programs, tiny_model
from test_lossless import (
    exact_joint,
    g_test,
    generate_samples,
    later_samples,
    models,  # noqa: F401 (fixture)
    pooled_pvalue,
    tail_joints,  # noqa: F401 (fixture)
    tail_pvalues,
)

import specjax as sj
from specjax import attention, engine, verify
from specjax import cache as kv
from specjax.sampling import Filters, SamplingArrays
from specjax.tree import Tree

SEED_EXAMPLE = ((0,), (1,), (0, 0), (0, 1))  # the [r, a, b, c, d] tree of specjax/tree.py
TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # the example


# -- topology -------------------------------------------------------------------------------------

def test_seed_example_tables():
    tree = Tree(SEED_EXAMPLE)
    assert tree.num_nodes == 5 and tree.depth == 2
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2])
    np.testing.assert_array_equal(tree.ranks, [0, 0, 1, 0, 1])
    np.testing.assert_array_equal(tree.ancestors.astype(int), [[1, 0, 0, 0, 0],  # r
                                                               [1, 1, 0, 0, 0],  # a
                                                               [1, 0, 1, 0, 0],  # b
                                                               [1, 1, 0, 1, 0],  # c
                                                               [1, 1, 0, 0, 1]])  # d
    np.testing.assert_array_equal(tree.children, [[1, 2], [3, 4], [-1, -1], [-1, -1], [-1, -1]])
    assert tree.levels == ((1, 3), (3, 5))
    # positions are length + depth: c and d are both the second token after r
    assert list(10 + tree.depths) == [10, 11, 11, 12, 12]


def random_tree(rng, max_nodes=20):
    paths, frontier = [], [()]
    while frontier and len(paths) < max_nodes:
        parent = frontier.pop(rng.integers(len(frontier)))
        for r in range(rng.integers(1, 4)):
            if len(paths) < max_nodes and len(parent) < 6:
                paths.append(parent + (r,))
                frontier.append(parent + (r,))
    rng.shuffle(paths)  # any order in, breadth-first order out
    return [tuple(p) for p in paths]


@pytest.mark.parametrize("seed", range(20))
def test_tables_match_brute_force_on_random_trees(seed):
    paths = random_tree(np.random.default_rng(seed))
    tree = Tree(paths)
    nodes = [()] + list(tree.paths)
    assert sorted(nodes[1:]) == sorted(paths)
    for i, a in enumerate(nodes):
        assert tree.depths[i] == len(a)
        for j, b in enumerate(nodes):  # j is an ancestor-or-self of i iff b is a prefix of a
            assert tree.ancestors[i, j] == (a[:len(b)] == b)
        if i:
            assert nodes[tree.parents[i]] == a[:-1] and tree.ranks[i] == a[-1]
        kids = [j for j, b in enumerate(nodes) if len(b) == len(a) + 1 and b[:-1] == a]
        assert [k for k in tree.children[i] if k >= 0] == sorted(kids, key=lambda k: nodes[k])
    for d, (start, stop) in enumerate(tree.levels, start=1):
        assert (tree.depths[start:stop] == d).all() and (tree.depths == d).sum() == stop - start


@pytest.mark.parametrize("paths,message", [
    ([], "no nodes"),
    ([()], "must not be empty"),
    ([(0,), (0, 1)], "skips a rank"),
    ([(1,)], "skips a rank"),
    ([(0, 0)], "has no parent"),
    ([(0,), (0,)], "appears twice"),
    ([(0,), (-1,)], "ints >= 0"),
    ([(0,), ("a",)], "ints >= 0"),
    ("0", "list of paths"),
    ([(0,) * d for d in range(1, 18)], "depth 17"),
    ([(i,) for i in range(65)], "at most 64"),
])
def test_bad_trees_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree(paths)


def test_spec_config_tree():
    spec = sj.SpecConfig(tree=[[1], [0], [0, 0]])  # JSON-style lists, any order
    assert spec.tree == ((0,), (1,), (0, 0)) and spec.num_speculative_tokens == 3
    assert sj.SpecConfig.parse(json.dumps({"tree": [[0], [0, 0]]})).tree == ((0,), (0, 0))
    assert hash(spec) == hash(sj.SpecConfig(tree=((0,), (1,), (0, 0))))  # a static config
    with pytest.raises(ValueError, match="num_speculative_tokens=4 but the tree has 3 nodes"):
        sj.SpecConfig(tree=((0,), (1,), (0, 0)), num_speculative_tokens=4)
    with pytest.raises(ValueError, match="not supported with method 'ngram'"):
        sj.SpecConfig(method="ngram", tree=((0,),))
    with pytest.raises(ValueError, match="has no parent"):
        sj.SpecConfig(tree=((0, 0),))
    assert sj.SpecConfig().num_speculative_tokens == 4  # chains keep their default


def test_windowed_chunk_mask():
    """A [T, W] chunk mask covers the W - T slots before the chunk too (tree levels)."""
    tree = Tree(SEED_EXAMPLE)
    start, stop = tree.levels[1]  # depth-2 nodes c, d written after r, a, b
    length = jnp.array([3])  # root r at slot 3; c, d written at slots 6, 7
    mask = kv.attention_mask(length + start, jnp.asarray(tree.ancestors[start:stop, :stop]), 10)
    want = np.zeros((2, 10), bool)
    want[:, :4] = True  # history and the root
    want[0, [4, 6]] = want[1, [4, 7]] = True  # each its parent a and itself, never b
    np.testing.assert_array_equal(mask[0], want)
    square = kv.attention_mask(length, kv.causal_mask(3), 10)  # W == T: the old behaviour
    np.testing.assert_array_equal(square[0, :, 3:6], np.tril(np.ones((3, 3), bool)))


# -- the acceptance rule, exactly ----------------------------------------------------------------

def conditional(prefix, V, temperature=1.0):
    """A fixed 'true' next-token distribution for every prefix (a tiny world to verify in)."""
    rng = np.random.default_rng(zlib.crc32(repr(tuple(int(x) for x in prefix)).encode()))
    logits = rng.normal(size=V) * 1.5
    p = np.exp(logits / temperature)
    return p / p.sum()


def one_round(tree, V, node_tokens):
    """target_probs [1, N, V] for a tree whose non-root nodes carry node_tokens."""
    nodes = [()] + list(tree.paths)
    index = tree.index
    tokens_of = lambda path: [node_tokens[index[path[:i + 1]] - 1] for i in range(len(path))]  # noqa: E731
    return np.stack([conditional(tokens_of(n), V) for n in nodes])[None]


def exact_outcomes(tree, node_tokens, target_probs):
    """P(emitted sequence) for one round, by walking the rule's probabilities (sibling_probs)."""
    children, V = tree.children, target_probs.shape[-1]
    out = {}

    def walk(node, prob, emitted):
        kids = [k for k in children[node] if k >= 0]
        p = jnp.asarray(target_probs[:, node])
        toks = jnp.asarray([[node_tokens[k - 1] for k in kids]], jnp.int32).reshape(1, len(kids))
        accept, residual = verify.sibling_probs(p, toks, jnp.ones_like(toks, bool))
        accept, residual = np.asarray(accept[0], np.float64), np.asarray(residual[0], np.float64)
        reach = prob
        for c, k in enumerate(kids):
            walk(k, reach * accept[c], emitted + (node_tokens[k - 1],))
            reach *= 1 - accept[c]
        for x in range(V):
            out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + reach * residual[x]

    walk(0, 1.0, ())
    return out


def completed(outcomes, V, depth):
    """Extend each emitted sequence autoregressively to depth + 1 tokens: a distribution over
    V^(depth+1) sequences that must equal autoregressive sampling if the rule is lossless."""
    joint = {}
    for seq, prob in outcomes.items():
        stack = [(seq, prob)]
        while stack:
            s, q = stack.pop()
            if len(s) == depth + 1:
                joint[s] = joint.get(s, 0.0) + q
                continue
            p = conditional(list(s), V)
            stack.extend((s + (x,), q * p[x]) for x in range(V))
    return joint


def autoregressive(V, depth):
    joint = {}
    for s in itertools.product(range(V), repeat=depth + 1):
        joint[s] = np.prod([conditional(list(s[:i]), V)[s[i]] for i in range(depth + 1)])
    return joint


TREES = [SEED_EXAMPLE, TREE, ((0,), (1,), (2,), (0, 0), (2, 0), (2, 1)), ((0,), (0, 0), (0, 0, 0))]


@pytest.mark.parametrize("paths", TREES, ids=["seed", "issue", "wide", "chain"])
@pytest.mark.parametrize("candidates", ["distinct", "likely"])
def test_tree_rule_is_lossless_by_enumeration(paths, candidates):
    V = 4
    tree = Tree(paths)
    rng = np.random.default_rng(0)
    node_tokens, orders = [], {}
    for path in tree.paths:  # siblings distinct; "likely": ranked as the target ranks
        if candidates == "distinct":  # one random order of the vocabulary per parent
            order = orders.setdefault(path[:-1], rng.permutation(V))
            node_tokens.append(int(order[path[-1]]))
        else:
            parent = path[:-1]
            prefix = [node_tokens[tree.index[parent[:j + 1]] - 1] for j in range(len(parent))]
            node_tokens.append(int(np.argsort(-conditional(prefix, V))[path[-1]]))
    for parent in {path[:-1] for path in tree.paths}:
        siblings = [node_tokens[tree.index[path] - 1] for path in tree.paths if path[:-1] == parent]
        assert len(set(siblings)) == len(siblings), (parent, siblings)
    target_probs = one_round(tree, V, node_tokens)
    joint = completed(exact_outcomes(tree, node_tokens, target_probs), V, tree.depth)
    want = autoregressive(V, tree.depth)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-6)
    for s, prob in want.items():
        assert joint.get(s, 0.0) == pytest.approx(prob, abs=1e-6), s


def test_keeping_rejected_siblings_breaks_the_enumeration(monkeypatch):
    """The control: trying the next sibling against p itself (rejected tokens not removed)."""
    V, tree = 4, Tree(TREE)
    node_tokens = [0, 1, 2, 3, 0, 1]
    target_probs = one_round(tree, V, node_tokens)
    monkeypatch.setattr(verify, "_remove", lambda p, token, where: p)
    joint = completed(exact_outcomes(tree, node_tokens, target_probs), V, tree.depth)
    want = autoregressive(V, tree.depth)
    assert max(abs(joint.get(s, 0.0) - prob) for s, prob in want.items()) > 1e-2


def draft_conditional(prefix, V):
    """A drafter's distribution after each prefix: near the target's but not equal, and zero on
    one token (a draft vocabulary's gap) where the prefix is long enough."""
    rng = np.random.default_rng(zlib.crc32(repr(("draft",) + tuple(prefix)).encode()))
    q = conditional(prefix, V) * np.exp(rng.normal(size=V) * 0.7)
    if len(prefix) >= 1:
        q[(sum(prefix) + 1) % V] = 0.0
    return q / q.sum()


def draws_without_replacement(q, count):
    """Every ordered draw of ``count`` tokens without replacement from q, with its probability;
    once q's mass is used up, the remaining draws are token 0, as
    ``sampling.sample_without_replacement`` gives them."""
    def rec(q, drawn, prob):
        if len(drawn) == count:
            yield tuple(drawn), prob
            return
        if q.sum() <= 0:  # what the sampler gives then: token 0, spent or not
            yield tuple(drawn) + (0,) * (count - len(drawn)), prob
            return
        for x in range(len(q)):
            if q[x] > 0:
                left = q.copy()
                left[x] = 0
                yield from rec(left / left.sum() if left.sum() > 0 else left, drawn + [x],
                               prob * q[x])
    yield from rec(np.asarray(q, np.float64), [], 1.0)


def exact_outcomes_sampled(tree, V, rule, draft=None):
    """P(emitted sequence) for one round of recursive rejection sampling: every node's children
    are drawn without replacement from the drafter's q after the node, every ordered draw
    enumerated with its probability."""
    rule = jax.jit(rule)
    out = {}

    def walk(node, prefix, prob):
        kids = [k for k in tree.children[node] if k >= 0]
        p, q = conditional(prefix, V), (draft or draft_conditional)(prefix, V)
        if not kids:
            for x in range(V):
                out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + prob * p[x]
            return
        for combo, weight in draws_without_replacement(q, len(kids)):
            reach = prob * weight
            accept, residual = rule(jnp.asarray(p[None], jnp.float32),
                                    jnp.asarray(q[None], jnp.float32),
                                    jnp.asarray([combo], jnp.int32),
                                    jnp.ones((1, len(kids)), bool))
            accept, residual = np.asarray(accept[0], np.float64), np.asarray(residual[0],
                                                                              np.float64)
            for c, k in enumerate(kids):
                walk(k, prefix + (combo[c],), reach * accept[c])
                reach *= 1 - accept[c]
            for x in range(V):
                out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + reach * residual[x]

    walk(0, (), 1.0)
    return out


def _without_residual_update(p, q, child_tokens, child_valid):
    """A control: every sibling tried against p itself (rejections leave p unchanged)."""
    accept = []
    for c in range(child_tokens.shape[1]):
        tok = child_tokens[:, c]
        p_x = jnp.take_along_axis(p, tok[:, None], axis=1)[:, 0]
        q_x = jnp.take_along_axis(q, tok[:, None], axis=1)[:, 0]
        accept.append(jnp.where(child_valid[:, c], jnp.minimum(1.0, p_x / q_x), 0.0))
        q = verify._remove(q, tok, child_valid[:, c])
    rest = jnp.maximum(p - q, 0.0)
    return jnp.stack(accept, axis=1), rest / jnp.sum(rest, axis=-1, keepdims=True)


def _as_if_drawn_with_replacement(p, q, child_tokens, child_valid):
    """A control: SpecInfer's rule for independent draws (q never loses a drawn token) applied
    to draws made without replacement."""
    accept = []
    for c in range(child_tokens.shape[1]):
        tok, ok = child_tokens[:, c], child_valid[:, c]
        p_x = jnp.take_along_axis(p, tok[:, None], axis=1)[:, 0]
        q_x = jnp.take_along_axis(q, tok[:, None], axis=1)[:, 0]
        accept.append(jnp.where(ok & (q_x > 0), jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30)),
                                0.0))
        rest = jnp.maximum(p - q, 0.0)
        mass = jnp.sum(rest, axis=-1, keepdims=True)
        p = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), p)
    return jnp.stack(accept, axis=1), p


@pytest.mark.parametrize("paths", [SEED_EXAMPLE, ((0,), (1,), (2,), (0, 0), (2, 0)),
                                   ((0,), (0, 0), (0, 0, 0))], ids=["seed", "wide", "chain"])
def test_the_multi_draft_rule_is_lossless_by_enumeration(paths):
    """Children drawn from q without replacement and tried with min(1, p_c/q_c), p_{c+1} =
    norm(max(p_c - q_c, 0)), q_{c+1} = q_c without x_c: one round, completed
    autoregressively, equals autoregressive sampling exactly (4-token vocabulary; q has zeros
    the target does not)."""
    V, tree = 4, Tree(paths)
    joint = completed(exact_outcomes_sampled(tree, V, verify.sampled_sibling_probs), V,
                      tree.depth)
    want = autoregressive(V, tree.depth)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    for seq, prob in want.items():
        assert joint.get(seq, 0.0) == pytest.approx(prob, abs=2e-6), seq


def _two_token_draft(prefix, V):
    """A drafter with only two tokens of mass (a tight top-k): a node with three children has a
    third draw that is not a draw at all."""
    q = draft_conditional(prefix, V)
    q[np.argsort(q)[:V - 2]] = 0.0
    return q / q.sum()


def _trusting_spent_draws(p, q, child_tokens, child_valid):
    """A control: the rule without its check that q_c still gives the child mass."""
    accept = []
    for c in range(child_tokens.shape[1]):
        tok = child_tokens[:, c]
        p_x = jnp.take_along_axis(p, tok[:, None], axis=1)[:, 0]
        q_x = jnp.take_along_axis(q, tok[:, None], axis=1)[:, 0]
        accept.append(jnp.minimum(1.0, jnp.nan_to_num(p_x / q_x, nan=1.0, posinf=1.0)))
        rest = jnp.maximum(p - q, 0.0)
        mass = jnp.sum(rest, axis=-1, keepdims=True)
        p = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), p)
        cut = jnp.where(jax.nn.one_hot(tok, q.shape[-1], dtype=bool), 0.0, q)
        q = cut / jnp.maximum(jnp.sum(cut, axis=-1, keepdims=True), 1e-30)
    return jnp.stack(accept, axis=1), p


@pytest.mark.parametrize("rule,exact", [(verify.sampled_sibling_probs, True),
                                        (_trusting_spent_draws, False)],
                         ids=["rule", "control-trusting-spent-draws"])
def test_the_multi_draft_rule_skips_draws_past_the_drafts_mass(rule, exact):
    """Three children, two tokens with mass: the third draw is token 0 whatever it is, and must
    never be accepted; the real rule stays exact, a rule that trusts it does not."""
    V, tree = 4, Tree(((0,), (1,), (2,), (0, 0), (2, 0)))
    joint = completed(exact_outcomes_sampled(tree, V, rule, _two_token_draft), V, tree.depth)
    want = autoregressive(V, tree.depth)
    worst = max(abs(joint.get(seq, 0.0) - prob) for seq, prob in want.items())
    assert (worst < 2e-6) if exact else (worst > 1e-2)


@pytest.mark.parametrize("broken", [_without_residual_update, _as_if_drawn_with_replacement],
                         ids=["no-residual-update", "as-if-independent"])
def test_the_multi_draft_enumeration_catches_broken_rules(broken):
    V, tree = 4, Tree(SEED_EXAMPLE)
    joint = completed(exact_outcomes_sampled(tree, V, broken), V, tree.depth)
    want = autoregressive(V, tree.depth)
    assert max(abs(joint.get(seq, 0.0) - prob) for seq, prob in want.items()) > 1e-2


def test_tree_sample_draws_from_the_rule():
    """tree_sample's outcomes (emitted tokens and accepted nodes) occur with the probabilities
    that the enumeration gives, and the path it reports leads to the tokens it emits."""
    V, tree, B = 4, Tree(TREE), 100_000
    node_tokens = [0, 1, 2, 3, 0, 1]
    target_probs = one_round(tree, V, node_tokens)
    exact = exact_outcomes(tree, node_tokens, target_probs)
    keys = jax.random.split(jax.random.key(3), B)
    verdict = jax.jit(verify.tree_sample, static_argnums=1)(
        keys, tree, jnp.tile(jnp.asarray(node_tokens, jnp.int32), (B, 1)),
        jnp.tile(jnp.asarray(target_probs, jnp.float32), (B, 1, 1)))
    tokens, n, path = map(np.asarray, (verdict.tokens, verdict.num_accepted, verdict.path))
    emitted = [tuple(row[:k + 1]) for row, k in zip(tokens, n)]
    for row, k, p in zip(tokens[:200], n[:200], path[:200]):
        assert list(row[:k]) == [node_tokens[i - 1] for i in p[:k]] and (row[k + 1:] == -1).all()
        assert all(tree.parents[p[j]] == (p[j - 1] if j else 0) for j in range(k))
    keys_ = sorted(exact)
    counts = np.array([0] * len(keys_))
    index = {s: i for i, s in enumerate(keys_)}
    for s in emitted:
        counts[index[s]] += 1
    expected = np.array([exact[s] for s in keys_])
    assert expected.sum() == pytest.approx(1.0, abs=1e-6)
    assert pooled_pvalue(counts, expected / expected.sum()) > 1e-3  # float32 rounding in the sum


def test_greedy_rule_follows_the_argmax_path():
    V, tree = 5, Tree(TREE)
    # one-hot targets: argmax after the root is 3, after (3) is 1, after anything else 0
    node_tokens = [2, 3, 4, 1, 0, 0]  # node 2 (rank 1) = 3 matches; its child (1,0) = 0 does not
    probs = np.zeros((1, tree.num_nodes, V), np.float32)
    probs[0, 0, 3] = 1  # root -> 3
    probs[0, 1:, 0] = 1
    probs[0, 2, :] = 0
    probs[0, 2, 1] = 1  # after 3 comes 1; node 5 (1,0) proposes 0: rejected, recover 1
    verdict = verify.tree_sample(jax.random.split(jax.random.key(0), 1), tree,
                                 jnp.asarray([node_tokens], jnp.int32), jnp.asarray(probs))
    assert int(verdict.num_accepted[0]) == 1
    assert list(np.asarray(verdict.tokens[0])) == [3, 1, -1, -1]
    assert int(verdict.path[0, 0]) == 2


# -- the engine ---------------------------------------------------------------------------------

GREEDY_TREES = [TREE, SEED_EXAMPLE, ((0,), (1,), (2,), (0, 0), (2, 0), (2, 1)),
                ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))]


@pytest.fixture(scope="module")
def greedy_setup():
    target = tiny_model(seed=1, vocab_size=64, layers=2)
    close = sj.Model(target.config, perturbed(target.params, 5, 0.1))  # often right
    drafts = {"other": close, "same": target}
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11, [5]]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=23)
    return target, drafts, prompts, sampling, sj.generate(target, prompts, sampling=sampling)


@pytest.mark.parametrize("paths", GREEDY_TREES, ids=["issue", "seed", "wide", "deep"])
@pytest.mark.parametrize("which", ["other", "same"])
def test_greedy_tree_equals_autoregressive(greedy_setup, paths, which):
    target, drafts, prompts, sampling, ar = greedy_setup
    out = sj.generate(target, prompts, sampling=sampling, draft=drafts[which],
                      spec=sj.SpecConfig(tree=paths))
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    tree = Tree(paths)
    s = out.stats
    assert s.per_position_acceptance.shape == (tree.depth,)
    assert s.accepted_length_distribution.shape == (tree.depth + 1,)
    assert s.accepted_length_distribution.sum() == pytest.approx(1.0)
    assert s.mean_accepted_length == pytest.approx(
        1 + (np.arange(tree.depth + 1) * s.accepted_length_distribution).sum())
    # every round proposes all N - 1 nodes for each active row
    assert s.proposed_tokens % (tree.num_nodes - 1) == 0
    assert s.proposed_tokens >= (tree.num_nodes - 1) * s.num_rounds
    if which == "same":  # the draft is the target: its rank-0 path is always right
        rank0_depth = max(len(p) for p in tree.paths if set(p) == {0})
        assert s.per_position_acceptance[rank0_depth - 1] > 0.7
    else:
        assert s.accepted_tokens > 0


def test_trees_with_sliding_windows_decode_greedy_exactly(greedy_setup):
    """A target whose window (2) is shorter than the tree is deep (4), its first layer sliding
    and its second full, and a draft that slides on every layer: the verify forward hides each
    node's keys by the node's own position, so the output equals plain greedy decoding."""
    _, _, prompts, sampling, _ = greedy_setup
    target = tiny_model(seed=3, vocab_size=64, hidden_size=16, layers=2, sliding_window=2,
                        layer_types=("sliding_attention", "full_attention"))
    draft = tiny_model(seed=4, vocab_size=64, hidden_size=8, layers=1, sliding_window=2)
    # a perturbed copy of the target: paths accepted partway, past the window, then rejected
    close = sj.Model(target.config, perturbed(target.params, 2, 0.05))
    # breadth first, node (0, 0, 0, 0) sits at slot 8 but position 4 past the root, and its
    # ancestor (0, 0) at slot 4, position 2: out of the window, though their slots are close
    wide = ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0), (0, 0, 0, 0))
    want = sj.generate(target, prompts, sampling=sampling).tokens
    for d in (draft, close, target):  # target as its own draft: deep paths are accepted
        got = sj.generate(target, prompts, sampling=sampling, draft=d,
                          spec=sj.SpecConfig(tree=wide))
        np.testing.assert_array_equal(got.tokens, want)
        if d is close:
            s = got.stats
            assert s.per_position_acceptance[3] > 0 and s.rejecting_rounds > 0, s
    assert got.stats.per_position_acceptance[3] > 0.5


def test_tree_errors(greedy_setup):
    target, drafts, prompts, sampling, _ = greedy_setup
    with pytest.raises(ValueError, match="needs a draft model"):
        sj.generate(target, prompts, sampling=sampling, spec=sj.SpecConfig(tree=SEED_EXAMPLE))


def test_committed_cache_equals_plain_decoding(greedy_setup):
    """After each tree round, the target's and the draft's caches hold what decoding the accepted
    tokens one by one would have written (K and V compared), for every row. The draft's slot of
    the last accepted token is left out: the next round's catch-up forward writes it again, and
    when the path ended at a leaf that no draft forward expanded (``Tree.expanded``) it holds
    nothing yet."""
    target, drafts, prompts, _, _ = greedy_setup
    draft = drafts["other"]
    tree = Tree(TREE)
    proposer = sj.draft.DraftTreeProposer(draft.config, tree)
    plan = engine.Plan(target.config, proposer, 64, Filters(top_k=0, top_p=False))
    B, P = len(prompts), 16
    padded = np.zeros((B, P), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    request = engine.Request(
        keys=jax.random.split(jax.random.key(0), B),
        sampling=SamplingArrays(temperature=jnp.full((B,), 0.7),
                                            top_k=jnp.zeros((B,), jnp.int32),
                                            top_p=jnp.ones((B,))),
        max_new_tokens=jnp.full((B,), 30, jnp.int32), eos=jnp.full((8,), -1, jnp.int32))
    program = engine.Program(plan)
    state = program.prefill(target.params, sj.DraftModel(draft), jnp.asarray(padded), lengths,
                            request)
    deep = 0
    for _ in range(5):
        old = np.asarray(state.length)
        state = program.step(target.params, sj.DraftModel(draft), request, state)
        length = np.asarray(state.length)
        deep += int(np.sum(length - old - 1 >= 2))
        for b in range(B):
            seq = jnp.asarray(state.history[b:b + 1, :length[b]])
            for model, cache, upto in [(target, state.cache, length[b]),
                                       (draft, state.draft_state,
                                        min(length[b] - 1, old[b] + 3))]:
                positions = jnp.arange(seq.shape[1])[None]
                _, _, ref = sj.forward(model, seq, positions, sj.KVCache.init(model.config, 1,
                                                                              seq.shape[1]))
                # the draft holds nodes up to depth D - 1 = 2 after the root (slot old[b]), the
                # path's moved ones (compacted) included
                np.testing.assert_allclose(cache.k[:, b, :, :upto], ref.k[:, 0, :, :upto],
                                           atol=2e-5)
                np.testing.assert_allclose(cache.v[:, b, :, :upto], ref.v[:, 0, :, :upto],
                                           atol=2e-5)
    assert deep > 0  # paths of depth >= 2 were accepted and compacted


# -- end to end distributions -------------------------------------------------------------------

@pytest.mark.parametrize("paths,block", [(TREE, None), (((0,), (1,), (2,), (0, 0), (1, 0)), 4)],
                         ids=["issue", "wide-in-blocks"])
def test_first_three_tokens_follow_the_target_with_a_tree(models, monkeypatch, paths, block):
    """block=4: attention walks the cache in 4-slot blocks (ancestor masks span blocks)."""
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    target, drafts = models
    t, k = 0.8, 5
    sampling = sj.SamplingParams(temperature=t, top_k=k, max_new_tokens=3)
    samples = generate_samples(target, drafts["close"], sampling, sj.SpecConfig(tree=paths))
    assert g_test(samples, exact_joint(target, t, k, 1.0)) > 1e-3


def test_later_tokens_follow_the_target_with_a_tree(models, tail_joints, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 4)  # rows of two lengths walk different block counts
    target, drafts = models
    out = later_samples(target, drafts["close"], None, tree=TREE)
    assert out.stats.per_position_acceptance[1] > 0.05  # deep paths (and compaction) happen
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_tree_without_residual_update_fails_end_to_end(models, monkeypatch, fresh_programs):
    """At T > 0 a draft-model tree's children are sampled without replacement and verified by
    recursive rejection sampling; the same rule without its residual update fails the test the
    real one passes."""
    target, drafts = models
    monkeypatch.setattr(verify, "sampled_sibling_probs", _without_residual_update)
    t, k = 0.8, 5
    sampling = sj.SamplingParams(temperature=t, top_k=k, max_new_tokens=3)
    samples = generate_samples(target, drafts["close"], sampling,
                               sj.SpecConfig(tree=((0,), (1,), (2,), (0, 0), (1, 0))))
    assert g_test(samples, exact_joint(target, t, k, 1.0)) < 1e-6


def test_each_level_ranks_only_the_candidates_its_children_take():
    tree = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    assert [tree.ranks_under(d) for d in range(4)] == [2, 2, 1, 0]
    assert [Tree.chain(3).ranks_under(d) for d in range(4)] == [1, 1, 1, 0]


def test_each_level_expands_up_to_its_last_node_with_children():
    tree = Tree(TREE)  # depth 1: [0] and [1] have children; depth 2: [0, 0] of three
    assert [tree.expanded(d) for d in range(3)] == [2, 1, 0]
    assert [Tree(((0,), (1,), (2,), (1, 0))).expanded(d) for d in range(2)] == [2, 0]
    assert [Tree.chain(3).expanded(d) for d in range(3)] == [1, 1, 0]


def every_node(tree, d):
    """Tree.expanded as it was: every node of a level but the deepest."""
    start, stop = tree.levels[d]
    return stop - start if d + 1 < tree.depth else 0


def one_parent_short(tree, d):
    """Broken on purpose: a level of several nodes with children expands one too few."""
    start, stop = tree.levels[d]
    parents = np.flatnonzero(tree.children[start:stop, 0] >= 0)
    n = int(parents[-1]) + 1 if parents.size else 0
    return n - 1 if n >= 2 else n


def sampled_tree_runs(generate, monkeypatch):
    """``generate()``'s result with trees expanded up to each level's last node with children,
    with every node expanded, and with one node too few (each compiled afresh)."""
    runs = {}
    for name, rule in (("trimmed", Tree.expanded), ("every node", every_node),
                       ("one short", one_parent_short)):
        monkeypatch.setattr(Tree, "expanded", rule)
        release_programs()
        out = generate()
        runs[name] = (out.tokens, out.stats.accepted_tokens,
                      tuple(out.stats.per_position_acceptance))
    return runs


def same_run(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1:] == b[1:]


def test_trailing_leaves_need_no_draft_forward(greedy_setup, monkeypatch, fresh_programs):
    """A draft model expands each tree level up to its last node with children
    (``Tree.expanded``): the leaves after it have nothing under them. A sampled call then draws
    the same drafts, so the same tokens and acceptance, as expanding every node; a level
    expanded one node short is caught."""
    target, drafts, prompts = greedy_setup[:3]
    runs = sampled_tree_runs(lambda: sj.generate(
        target, prompts, sampling=sj.SamplingParams(temperature=0.8, max_new_tokens=23),
        draft=drafts["other"], spec=sj.SpecConfig(tree=TREE), key=3), monkeypatch)
    assert runs["trimmed"][1] > 0  # drafts were accepted
    assert same_run(runs["trimmed"], runs["every node"])
    assert not same_run(runs["trimmed"], runs["one short"])


def _sorts(target, draft, tree):
    """Sort instructions in the greedy decode program of ``tree``."""
    release_programs()
    sj.generate(target, [[1, 2, 3]], sampling=sj.SamplingParams(temperature=0, max_new_tokens=8),
                draft=draft, spec=sj.SpecConfig(tree=tree))
    (decode,) = engine.PROGRAMS.programs()[-1].executables("decode")
    return decode.as_text().count(" sort(")


def test_a_greedy_tree_sorts_no_vocabulary(greedy_setup, monkeypatch, fresh_programs):
    """A level whose nodes take one child each ranks it by an argmax: XLA's CPU backend lowered
    the top-k of a level where only the top-ranked candidate was read to a sort of the whole
    vocabulary (2 ms a round over 8,192 tokens). Ranking the tree's widest fan-out at every
    level, as before, brings the sort back."""
    target, drafts = greedy_setup[:2]
    # depth 1 expands three nodes (up to its last with a child, Tree.expanded) whose children
    # are all top-ranked ones
    tree = ((0,), (1,), (2,), (1, 0), (2, 0), (2, 0, 0))
    assert _sorts(target, drafts["other"], tree) == 0
    monkeypatch.setattr(Tree, "ranks_under", lambda self, d: int(self.children.shape[1]))
    jax.clear_caches()
    assert _sorts(target, drafts["other"], tree) > 0


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_tree_verdict_is_tree_sample_with_one_hot_p(seed):
    """Greedy calls verify a tree from the target's argmax after each node
    (``verify.greedy_tree_verdict``): the same tokens, accepted counts and paths as
    ``tree_sample`` with the one-hot p greedy processing gives, on random trees whose drafts
    often match (a 3-token vocabulary), with unproposed nodes and NaN logits mixed in."""
    rng = np.random.default_rng(seed)
    tree = Tree(random_tree(rng, max_nodes=12))
    B, N, V = 64, tree.num_nodes, 3
    logits = rng.normal(size=(B, N, V)).astype(np.float32)
    logits[rng.random((B, N)) < 0.05, 0] = np.nan
    argmax = sj.sampling.argmax(jnp.asarray(logits))
    one_hot = jax.nn.one_hot(argmax, V)
    drafts = jnp.asarray(rng.integers(0, V, (B, N - 1)), jnp.int32)
    valid = jnp.asarray(rng.random((B, N - 1)) < 0.9)
    keys = jax.random.split(jax.random.key(seed), B)
    want = verify.tree_sample(keys, tree, drafts, one_hot, valid)
    got = verify.greedy_tree_verdict(tree, drafts, argmax, valid)
    for a, b in ((got.tokens, want.tokens), (got.num_accepted, want.num_accepted),
                 (got.path, want.path)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(want.num_accepted.max()) >= 2  # long paths were taken, not only stops


def test_tree_positions_taken_from_the_node_index_fail(greedy_setup, monkeypatch, fresh_programs):
    """Broken on purpose (a PITFALLS entry): the verify forward places each node at the row's
    length plus its index in the tree's order instead of plus its depth. Trees with siblings
    then leave autoregressive decoding; a chain-shaped tree, where the two agree, does not."""
    target, drafts, prompts, sampling, ar = greedy_setup
    honest = engine.forward

    def by_index(model, chunk, positions, *args, chunk_mask=None, **kwargs):
        if chunk_mask is not None:  # a tree's verify: the root's position, then one per node
            positions = positions[:, :1] + jnp.arange(positions.shape[1])[None, :]
        return honest(model, chunk, positions, *args, chunk_mask=chunk_mask, **kwargs)
    monkeypatch.setattr(engine, "forward", by_index)
    for paths, parts in [(GREEDY_TREES[2], True), (GREEDY_TREES[3], False)]:  # wide, deep
        out = sj.generate(target, prompts, sampling=sampling, draft=drafts["other"],
                          spec=sj.SpecConfig(tree=paths))
        assert np.array_equal(out.tokens, ar.tokens) is not parts, paths
