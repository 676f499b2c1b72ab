"""A module that starts a thread at import: a zygote must refuse to fork after it."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
