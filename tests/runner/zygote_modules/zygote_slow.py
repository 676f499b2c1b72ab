"""A module whose import takes longer than the test lets a zygote take to start."""

import time

time.sleep(30)
