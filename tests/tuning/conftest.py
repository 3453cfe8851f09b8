"""Fixtures for the tuning tests: a tiny model and one small tuning log shared by the session."""

import json
import shutil

import pytest
from tuning_support import DTYPE, LEVEL, TARGET, TRIALS, tiny_model


@pytest.fixture(scope="session")
def tuned_log(tmp_path_factory):
    """A log of TRIALS trials for the tiny model (tuned once per test session)."""
    from tvmamp.tuning import tune

    mod, params = tiny_model()
    work_dir = tmp_path_factory.mktemp("tuned") / "log"
    result = tune(mod, TARGET, LEVEL, DTYPE, work_dir, TRIALS, params, progress=False, seed=1)
    return work_dir, result


@pytest.fixture
def log_copy(tuned_log, tmp_path):
    """A private copy of the shared log that a test may damage."""
    return shutil.copytree(tuned_log[0], tmp_path / "log")


@pytest.fixture
def log_to_apply(log_copy):
    """A copy whose default-schedule timings are removed, so a build applies every record
    whichever was faster on the day (with a handful of trials the hand-written defaults usually
    win). Tuning into it again would time the defaults again: use it for loading only.
    """
    work_dir = log_copy
    path = work_dir / "tvmamp_manifest.json"
    manifest = json.loads(path.read_text())
    for task in manifest["tasks"]:
        task.pop("default_ms", None)
    path.write_text(json.dumps(manifest))
    return work_dir


@pytest.fixture
def converted():
    """The tiny model converted as the log was tuned (target, level, dtype)."""
    import tvmamp

    mod, params = tiny_model()
    return tvmamp.convert(mod, LEVEL, TARGET, DTYPE, params)
