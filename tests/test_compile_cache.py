"""specjax's compiled programs on disk (specjax/compile_cache.py): which folder, that a program
compiled once is read back instead of compiled again, and that the process's compiles before
and after specjax's keep their own settings."""

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
def no_cache(monkeypatch, tmp_path):
    """This process as a user's: no JAX cache folder, no specjax setting, the default folder
    under tmp_path/home. Every program is stored, however quickly it compiled (the tiny models'
    compile in well under JAX's default 1 s). The suite's own settings come back afterwards."""
    reset = jax_cache.reset_cache  # (a test may break the module's own)
    suite_dir = jax.config.jax_compilation_cache_dir
    suite_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_compilation_cache_dir", None)
    reset()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(compile_cache, "_chosen", compile_cache._UNSET)
    monkeypatch.setattr(compile_cache, "_warned", set())
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0)
    engine.PROGRAMS.clear()
    jax.clear_caches()
    yield tmp_path / "home" / "specjax" / "xla"
    engine.PROGRAMS.clear()
    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", suite_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", suite_min)
    reset()


@pytest.fixture
def cache_events():
    """Counts of JAX's persistent-cache hits while the test runs."""
    seen = {"hits": 0}

    def listen(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            seen["hits"] += 1
    jax.monitoring.register_event_listener(listen)
    yield seen
    jax.monitoring.unregister_event_listener(listen)


def decode(target):
    """One call (whose prefill and decode programs specjax compiles, or JAX reads back), after
    forgetting every program compiled in memory. Plain decoding: the smallest programs; every
    method's are compiled the same way."""
    engine.PROGRAMS.clear()
    jax.clear_caches()
    return sj.generate(target, [[1, 2, 3]], sampling=sj.SamplingParams(temperature=0,
                                                                        max_new_tokens=8))


def files(folder):
    return set(folder.iterdir()) if folder.exists() else set()


def users_own_compile(scale: int):
    """A program of the user's own, compiled outside specjax."""
    return jax.jit(lambda x: x * scale + 1)(jnp.arange(5)).block_until_ready()


def test_the_default_folder_is_private_and_a_new_process_would_read_it(no_cache, cache_events,
                                                                       target):
    first = decode(target)
    assert compile_cache.folder() == str(no_cache)
    assert stat.S_IMODE(no_cache.stat().st_mode) == 0o700
    assert len(files(no_cache)) >= 2  # a prefill and a decode program at least
    assert cache_events["hits"] == 0
    again = decode(target)  # compiled afresh in memory: read back from the folder
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert cache_events["hits"] >= 2, cache_events


@pytest.mark.parametrize("reopen", [True, False], ids=["reopened", "broken-never-reopened"])
def test_only_specjax_programs_go_to_its_folder_and_a_move_is_followed(no_cache, target,
                                                                       tmp_path, monkeypatch,
                                                                       reopen):
    """JAX opens its cache folder at the first compile that uses it and keeps it open. specjax
    reopens it before and after each of its compiles: the user's own programs stay out of
    specjax's folder, and a folder chosen later is the one written. Without the reopening
    (broken on purpose) both go wrong."""
    if not reopen:
        monkeypatch.setattr(compile_cache.jax_cache, "reset_cache", lambda: None)
    decode(target)
    ours = files(no_cache)
    users_own_compile(7)
    assert (files(no_cache) == ours) == reopen
    sj.set_compilation_cache(tmp_path / "moved")
    decode(target)
    assert bool(files(tmp_path / "moved")) == reopen


def test_off_and_who_decides(no_cache, target, monkeypatch, tmp_path):
    for off in ("off", "0", "false", "none", "OFF"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.folder() is None
    decode(target)
    assert not (tmp_path / "home").exists()
    # JAX's own folder, when the process has one and specjax has no setting of its own
    monkeypatch.delenv(compile_cache.ENV)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    decode(target)
    assert files(tmp_path / "users") and not (tmp_path / "home").exists()
    # specjax's variable over JAX's folder, for specjax's programs only
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    before = files(tmp_path / "users")
    decode(target)
    assert files(tmp_path / "env") and files(tmp_path / "users") == before
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "users")
    # and set_compilation_cache over both; None: specjax's programs are not cached at all
    sj.set_compilation_cache(None)
    before = files(tmp_path / "env") | files(tmp_path / "users")
    decode(target)
    assert files(tmp_path / "env") | files(tmp_path / "users") == before


def test_jax_switched_off_writes_nothing(no_cache, target, tmp_path):
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    try:
        decode(target)
        assert compile_cache.folder() is None
        assert not files(no_cache) and not files(tmp_path / "users")
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def test_a_folder_given_as_a_url_is_passed_on_as_it_is(no_cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(compile_cache.ENV, "gs://bucket/specjax")
    assert compile_cache.folder() == "gs://bucket/specjax"
    sj.set_compilation_cache("gs://other/cache")
    assert compile_cache.folder() == "gs://other/cache"
    assert not (tmp_path / "gs:").exists() and not no_cache.exists()


def test_a_file_url_is_the_local_folder_it_names(no_cache, monkeypatch, tmp_path):
    """file:///path is that folder (pathlib read it as the relative folder "file:/path", made
    in the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(compile_cache.ENV, f"file://{tmp_path}/from-env")
    assert compile_cache.folder() == str(tmp_path / "from-env")
    sj.set_compilation_cache(f"file://{tmp_path}/chosen")
    assert compile_cache.folder() == str(tmp_path / "chosen")
    assert (tmp_path / "chosen").is_dir() and not (tmp_path / "file:").exists()


def test_bad_settings_are_refused_by_name(tmp_path):
    for bad in (3, ""):
        with pytest.raises(TypeError, match="a folder or None, not"):
            sj.set_compilation_cache(bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="'.*file' is a file"):
        sj.set_compilation_cache(tmp_path / "file")
    with pytest.raises(OSError):
        sj.set_compilation_cache(tmp_path / "file" / "below")


@pytest.mark.parametrize("case", ["no-home", "open-to-others", "a-file", "a-link"])
def test_an_unusable_default_leaves_programs_uncached_and_decoding_on(no_cache, target,
                                                                      monkeypatch, tmp_path,
                                                                      caplog, case):
    if case == "no-home":
        monkeypatch.delenv("XDG_CACHE_HOME")

        def no_home():
            raise RuntimeError("Could not determine home directory.")
        monkeypatch.setattr(compile_cache.pathlib.Path, "home", staticmethod(no_home))
    elif case == "open-to-others":  # JAX runs what it finds there: not if others can write it
        no_cache.mkdir(parents=True)
        no_cache.chmod(0o777)
    elif case == "a-file":
        no_cache.parent.mkdir(parents=True)
        no_cache.write_text("x")
    else:  # a link to a private folder of ours: still not the folder specjax made
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        no_cache.parent.mkdir(parents=True)
        no_cache.symlink_to(tmp_path / "elsewhere")
    caplog.set_level("INFO", logger="specjax.compile_cache")
    out = decode(target)
    assert out.tokens.shape == (1, 8) and compile_cache.folder() is None
    assert "specjax's programs are not cached on disk" in caplog.text
    assert not no_cache.is_dir() or not files(no_cache)
    assert not (tmp_path / "elsewhere").exists() or not files(tmp_path / "elsewhere")


def test_the_folder_and_threshold_are_set_for_the_compiling_thread_alone(no_cache, monkeypatch):
    import threading

    from jax._src import config as jax_config
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0.2)
    with compile_cache.compiling():
        assert jax_config.compilation_cache_dir.value == str(no_cache)
        assert jax_config.persistent_cache_min_compile_time_secs.value == 0.2
        seen = []
        other = threading.Thread(target=lambda: seen.append(
            (jax_config.compilation_cache_dir.value,
             jax_config.persistent_cache_min_compile_time_secs.value)))
        other.start()
        other.join()
        assert seen == [(None, 0)]  # the process's own settings (the fixture's threshold: 0)
    assert jax.config.jax_compilation_cache_dir is None
