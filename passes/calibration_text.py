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
    (("user", "Can you explain what a prime number is?"),
     ("assistant", "A prime number is a whole number greater than 1 whose only divisors are 1 and itself, "
                   "such as 2, 3, 5, 7 and 11.")),
    (("user", "Write one sentence about autumn."),
     ("assistant", "In autumn the maple leaves turn red and gold, and the evenings grow cool and short.")),
    (("user", "How many minutes are in three hours?"),
     ("assistant", "Three hours have 3 × 60 = 180 minutes.")),
    (("user", "Who discovered penicillin?"),
     ("assistant", "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.")),
)

PLAIN: tuple[str, ...] = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the lens, and watched the fishing boats come home across the bay.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature and food takes longer to cook.",
    "The night train left the station ten minutes late. Most passengers were asleep before the first "
    "tunnel; a child at the window counted the lights of the villages instead.",
)
