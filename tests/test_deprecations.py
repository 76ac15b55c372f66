"""Old public names keep working for one version, each with a DeprecationWarning that names the
new one; and the small contracts the restructuring added (tree proposers' gamma, the program
cache's bound)."""

import dataclasses
import typing

import numpy as np
import pytest

import specjax as sj
from specjax import config, engine


@pytest.mark.parametrize("old,new", [("Drafter", "Heads"), ("DrafterConfig", "HeadsConfig"),
                                     ("init_drafter", "init_heads"),
                                     ("load_drafter", "load_heads"),
                                     ("save_drafter", "save_heads")])
def test_renamed_top_level_names_warn_and_still_work(old, new):
    with pytest.warns(DeprecationWarning, match=f"sj.{old} is renamed sj.{new}"):
        assert getattr(sj, old) is getattr(sj, new)


def test_the_old_drafter_namespace_and_loaders_warn(tmp_path):
    with pytest.warns(DeprecationWarning, match="specjax.draft.heads"):
        from specjax import drafter
    assert drafter.init_drafter is sj.init_heads and drafter.frequent_tokens is \
        sj.draft.frequent_tokens
    with pytest.warns(DeprecationWarning, match="renamed sj.load_draft_model"):
        with pytest.raises(FileNotFoundError):
            sj.draft.load_draft(tmp_path)
    with pytest.warns(DeprecationWarning, match="needs_heads"):
        assert sj.SpecConfig(method="eagle").needs_drafter
    with pytest.warns(DeprecationWarning, match="registry"):
        assert config.METHODS == sj.draft.names()
    with pytest.warns(DeprecationWarning):
        assert config.TREE_METHODS == ("draft_model", "medusa", "eagle", "dflash", "suffix",
                                       "lookahead")
    with pytest.raises(AttributeError):
        sj.no_such_name  # noqa: B018


@dataclasses.dataclass(frozen=True)
class WrongGammaTree:
    tree: typing.Any = None
    gamma: int = 2

    def init(self, params, prompts, prompt_lengths, capacity):
        return None

    def propose(self, params, state, history, length, keys, sampling, filters):
        raise AssertionError("never traced")


def test_a_tree_proposer_whose_gamma_is_not_its_node_count_is_refused(target):
    from specjax.tree import Tree
    proposer = WrongGammaTree(tree=Tree(((0,), (1,), (0, 0))), gamma=2)
    with pytest.raises(ValueError, match="tree of 3 nodes but has gamma=2"):
        sj.generate(target, [[1, 2]], proposer=proposer)


def _run(cache, target, batch, capacity):
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=4)
    rows = [np.array([1, 2], np.int32)] * batch
    plan, shapes = engine.plan_program(target.config, None, rows, greedy, None, capacity)
    cache.get(plan).run(target.params, None, engine.build_inputs(rows, greedy, 0, shapes, None))
    return plan


def test_the_program_cache_holds_at_most_its_size_in_executables(target):
    cache = engine.ProgramCache(size=3)
    # three capacities: three plans of two executables (prefill, decode) each
    plans = [_run(cache, target, 1, capacity) for capacity in (16, 24, 32)]
    assert len(set(plans)) == 3
    cache.get(plans[-1])  # a lookup drops the least recently used programs beyond the bound
    assert [p.plan for p in cache.programs()] == plans[-1:]
    # one plan, three batch buckets: six executables, trimmed to the three latest
    for batch in (1, 2, 3):
        _run(cache, target, batch, 32)
    program = cache.get(plans[-1])
    assert program.held == 3 and program.compiled == 6
    assert cache.compiled == 10  # 4 by the dropped programs, 6 by this one: none is forgotten
    cache.clear()
    assert cache.programs() == [] and cache.compiled == 10
