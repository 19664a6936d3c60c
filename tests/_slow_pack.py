"""``xprep`` with a pause before each pack entry is marked complete: ``python _slow_pack.py SECONDS ARGS...``.

Run by test_pack_cache.py in subprocesses, so that a build is still in flight (its arrays written, its
pack.json not yet) when another ``xprep pack`` starts or the test kills it.
"""

import sys
import time

import xprep.prep.pack.cache
from xprep import cli

seconds = float(sys.argv.pop(1))
mark_complete = xprep.prep.pack.cache._mark_complete


def slow_mark_complete(*args, **kwargs):
    time.sleep(seconds)
    return mark_complete(*args, **kwargs)


xprep.prep.pack.cache._mark_complete = slow_mark_complete
cli.xprep()
