"""``python -m aoti_sessions.serve._front_main FD``: one front end of
``aoti-sessions serve --api-workers N`` (serve/_fleet.py), serving the
listening socket FD; what it is told comes pickled on its stdin."""

import sys

from aoti_sessions.serve._fleet import front_end_main

if __name__ == "__main__":
    sys.exit(front_end_main(int(sys.argv[1])))
