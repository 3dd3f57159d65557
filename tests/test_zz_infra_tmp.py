# THROWAWAY (infra check) - to be deleted
import os

import django
import pytest
from django.contrib.auth.models import User
from django.db import connection


@pytest.mark.django_db
def test_zz_infra_db() -> None:
    User.objects.create(username="infra")
    assert User.objects.count() == 1
    name = connection.settings_dict["NAME"]
    with open("/tmp/infra_vendors.log", "a") as f:
        f.write(f"{django.get_version()} {connection.vendor} {name} {os.environ.get('CI')}\n")
