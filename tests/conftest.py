import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One demo-corpus cache for the whole session (built by the first run that needs it)."""
    return tmp_path_factory.mktemp("nvfp4-cache")
