"""The pytest plugin, registered by the package's ``pytest11`` entry point:
installing the app is enough for a project's tests to use its fixtures.

- ``delivery_outbox``: :data:`~django_federation_delivery.testing.outbox`,
  emptied before the test: what its sends queued, one ``Outgoing`` each;
- ``fake_inbox``: a started :class:`~.fake.FakeInbox`, answering every
  request a deliverer makes in the test and verifying its signature;

and, for every test, what the process kept from a test before (the hosts
marked unavailable) forgotten: a test passes or fails whatever ran first.

Loaded by pytest before Django is set up, in every project that has the
package installed: nothing is imported until a fixture is asked for (the
models, and the ``testing`` extra's packages).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from django_federation_delivery.testing import Outgoing
    from django_federation_delivery.testing.fake import FakeInbox


@pytest.fixture(autouse=True)
def _delivery_state_forgotten() -> Iterator[None]:
    """Every test of the project, whatever fixtures it asks for, starts with
    nothing a test before left in the process's memory (the hosts marked
    unavailable: ``testing.forget_kept``), and ends with no fake receiver
    it started left started (one it failed before stopping would answer
    the next tests, and patch their requests; one a wider fixture started
    before it is left). Where the package was never imported, there is
    nothing to forget, and nothing is imported."""
    if "django_federation_delivery.availability" in sys.modules:
        from django_federation_delivery import testing

        testing.forget_kept()
    with _fakes_started_within("stop_started_since"):
        yield


#: The fake receivers' module, imported only where the testing extra is used.
FAKE = "django_federation_delivery.testing.fake"


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object]) -> Iterator[None]:
    """A fake receiver a fixture wider than a test starts (a module's, the
    session's) is its own, left started as a test that asked for it ends,
    even when that test set the fixture up (``request.getfixturevalue``)."""
    if fixturedef.scope == "function":
        yield
        return
    with _fakes_started_within("keep_started_since"):
        yield


@contextlib.contextmanager
def _fakes_started_within(then: str) -> Iterator[None]:
    """Call the fake module's ``then`` (``stop_started_since``,
    ``keep_started_since``) on the fakes started within the block, if the
    module was imported by its end."""
    fake = sys.modules.get(FAKE)
    mark = fake.started_mark() if fake is not None else -1
    yield
    fake = sys.modules.get(FAKE)
    if fake is not None:
        getattr(fake, then)(mark)


@pytest.fixture
def delivery_outbox() -> Iterator[list[Outgoing]]:
    from django_federation_delivery import testing

    yield testing.capture()
    testing.stop_capturing()


@pytest.fixture
def fake_inbox() -> Iterator[FakeInbox]:
    from django_federation_delivery.testing.fake import FakeInbox

    with FakeInbox() as fake:
        yield fake
