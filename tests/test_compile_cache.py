"""The on-disk compilation cache (specjax/compile_cache.py): where it goes, who decides, and that
a program compiled once is read back instead of compiled again."""

from __future__ import annotations

import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

import specjax as sj
from specjax import compile_cache, engine


@pytest.fixture
def no_cache(monkeypatch):
    """This process as a user's: no JAX cache directory, no specjax choice yet, and a compile
    already made (so JAX has decided the process uses no cache). Every program is stored, however
    quickly it compiled (the tiny models' compile in well under JAX's default 1 s). The suite's
    own cache settings and specjax's state are put back afterwards."""
    reset = jax_cache.reset_cache  # (a test may break the module's own)
    suite_dir = jax.config.jax_compilation_cache_dir
    suite_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setattr(compile_cache, "_chosen", compile_cache._UNSET)
    monkeypatch.setattr(compile_cache, "_ensured", False)
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5)).block_until_ready()  # JAX decides: no cache
    engine.PROGRAMS.clear()
    jax.clear_caches()
    yield
    engine.PROGRAMS.clear()
    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", suite_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", suite_min)
    reset()


@pytest.fixture
def cache_events():
    """Counts of JAX's persistent-cache hit and miss events while the test runs."""
    seen = {"hits": 0, "misses": 0}

    def listen(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            seen["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            seen["misses"] += 1
    jax.monitoring.register_event_listener(listen)
    yield seen
    jax.monitoring.unregister_event_listener(listen)


def decode(target, draft):
    """One speculative call (whose programs specjax compiles, or JAX reads back)."""
    return sj.generate(target, [[1, 2, 3]], sampling=sj.SamplingParams(temperature=0,
                                                                        max_new_tokens=8),
                       draft=draft, spec=sj.SpecConfig(num_speculative_tokens=3))


def decode_twice(target, draft):
    """One speculative call, every compiled program forgotten in memory, the same call again."""
    first = decode(target, draft)
    engine.PROGRAMS.clear()
    jax.clear_caches()
    np.testing.assert_array_equal(first.tokens, decode(target, draft).tokens)


def test_the_default_folder_is_created_private_and_a_second_compile_reads_it(
        no_cache, cache_events, target, draft, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decode_twice(target, draft)
    folder = tmp_path / "specjax" / "xla"
    assert compile_cache.current() == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert len(list(folder.iterdir())) >= 2  # a prefill and a decode program at least
    # the second call compiled nothing it could read back: a hit for each program missed first
    assert cache_events["misses"] >= 2 and cache_events["hits"] >= 2, cache_events


@pytest.mark.parametrize("reset", [True, False], ids=["moved", "broken-no-reset"])
def test_a_moved_cache_is_written_where_it_now_is(no_cache, target, draft, monkeypatch,
                                                   tmp_path, reset):
    """JAX opens its cache folder at the first compile that uses it and keeps it open; moving the
    cache afterwards must make it open the new one (a reset), or programs go on to the old."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    decode(target, draft)  # written to the default folder
    if not reset:  # broken on purpose
        monkeypatch.setattr(compile_cache.jax_cache, "reset_cache", lambda: None)
    sj.set_compilation_cache(tmp_path / "moved")
    decode_twice(target, draft)
    written = (tmp_path / "moved").exists() and any((tmp_path / "moved").iterdir())
    assert written == reset


def test_off_writes_nothing_and_a_folder_of_the_users_own_is_kept(no_cache, target, draft,
                                                                    monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    for off in ("off", "0", "false", "none", ""):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.wanted() is None
    decode(target, draft)
    assert compile_cache.current() is None and not (tmp_path / "home").exists()
    # JAX's own directory wins over specjax's default and its environment variable
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
    monkeypatch.setattr(compile_cache, "_ensured", False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    engine.PROGRAMS.clear()
    decode(target, draft)
    assert compile_cache.current() == str(tmp_path / "users")
    assert not (tmp_path / "ours").exists()


def test_set_compilation_cache_moves_and_turns_off(no_cache, target, draft, monkeypatch,
                                                   tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    sj.set_compilation_cache(tmp_path / "chosen")  # an explicit choice wins over JAX's own
    assert compile_cache.current() == str(tmp_path / "chosen")
    decode(target, draft)
    assert any((tmp_path / "chosen").iterdir())
    sj.set_compilation_cache(None)
    assert compile_cache.current() is None
    engine.PROGRAMS.clear()
    decode(target, draft)  # the default does not come back
    assert compile_cache.current() is None


def test_bad_cache_settings_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="a directory or None, not 3"):
        sj.set_compilation_cache(3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="'.*file' is a file"):
        sj.set_compilation_cache(tmp_path / "file")


def test_an_unwritable_folder_leaves_the_cache_off_and_decoding_on(no_cache, target, draft,
                                                                   monkeypatch, tmp_path,
                                                                   caplog):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "file" / "xla"))
    decode(target, draft)
    assert compile_cache.current() is None
    assert "no compilation cache: cannot create" in caplog.text
