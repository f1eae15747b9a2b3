"""``python -m aoti_sessions.serve._front_main``: one front end of
``aoti-sessions serve --api-workers N`` (serve/_fleet.py); what it is told
comes pickled on its stdin."""

import sys

from aoti_sessions.serve._fleet import front_end_main

if __name__ == "__main__":
    sys.exit(front_end_main())
