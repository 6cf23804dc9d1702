"""The built-in calibration text of `quantize`: short chat conversations, rendered with the
model's own chat template where it has one, and plain prose and code.

A Python module rather than a data file, so that it installs with the package as it is
(no package data to declare) and a reader sees what the compiler calibrates on. Written
for this purpose: none of it is in the chat-answer check's questions or the held-out text
of `benchmarks/`. `calibration_tokens` (in `calibrate`) interleaves the pieces, a
conversation then a plain text, until it has enough tokens.
"""

from __future__ import annotations

CONVERSATIONS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("user", "Which city is the capital of Canada?"),
     ("assistant", "The capital of Canada is Ottawa, in the province of Ontario.")),
    (("user", "What is the difference between weather and climate?"),
     ("assistant", "Weather is what the atmosphere does on a given day; climate is the average of the weather "
                   "in a region over thirty years or more.")),
    (("user", "Write one sentence about a mountain village in winter."),
     ("assistant", "Snow covers the roofs of the little village, and smoke rises straight up from every chimney.")),
    (("user", "How many minutes are in three hours?"),
     ("assistant", "Three hours have 3 × 60 = 180 minutes.")),
    (("user", "Who discovered penicillin?"),
     ("assistant", "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.")),
)

PLAIN: tuple[str, ...] = (
    "The baker opened her shop at five every morning. By six the first loaves were cooling on the racks, "
    "and the smell of warm bread drifted down the empty street.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature and food takes longer to cook.",
    "The night train left the station ten minutes late. Most passengers were asleep before the first "
    "tunnel; a child at the window counted the lights of the villages instead.",
)
