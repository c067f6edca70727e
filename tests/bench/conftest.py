import pytest

from hayabusa.bench import report


@pytest.fixture(autouse=True)
def _no_switches_from_the_environment(monkeypatch):
    """Bench records keep the run's HAYABUSA_* switches (``report.hayabusa_switches``), and the table's config
    cell shows them; a machine that sets one (a CI harness, a device run) would change every record these tests
    read. Each test starts with none; one that wants a switch sets it itself."""
    for name in report.hayabusa_switches():
        monkeypatch.delenv(name)
    yield
