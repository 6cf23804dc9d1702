"""The built-in prompts of `llmc bench --speculate`: input-grounded ones (the answer copies from the prompt:
summarize, extract, rewrite, edit code, answer from a passage) and open-ended ones (nothing to copy).

Each is one user message, sent through the model's chat template.
"""

from __future__ import annotations

_PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, in the canton of Graubunden, and flows north "
    "through Lake Constance before turning west along the border between Switzerland and Germany. At Basel "
    "it turns north again and forms part of the border between France and Germany, then flows through the "
    "Rhineland and the Netherlands before emptying into the North Sea near Rotterdam. The river is about "
    "1,230 kilometres long. It has been an important shipping route since Roman times, and today barges "
    "carry coal, grain, chemicals and containers between the port of Rotterdam and the industrial cities "
    "of the Ruhr, such as Duisburg, which has the largest inland port in Europe."
)

_CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best
'''

_MEETING = (
    "Meeting notes, 14 March. Present: Alice Martin (engineering), Bob Chen (sales), Carla Diaz (support). "
    "Alice said the new search feature will ship on 2 April, one week later than planned, because the index "
    "rebuild takes longer than expected. Bob reported that the Northwind contract was signed for 48,000 euros "
    "per year and that the customer wants the search feature first. Carla said support tickets fell from 310 "
    "to 240 in February. Action items: Alice will send the new schedule to Bob by Friday; Bob will tell "
    "Northwind about the delay; Carla will write the help page for the search feature."
)

GROUNDED = (
    f"Edit this Python code: rename the function load_users to read_users and the variable users to people "
    f"everywhere. Reply with the whole edited code only.\n\n{_CODE}",
    f"Add a docstring to each function in this code and return the whole code.\n\n{_CODE}",
    f"Rewrite this passage, replacing every 'river' with 'stream', and change nothing else.\n\n{_PASSAGE}",
    f"Extract every person in these notes with their team and their action item, one per line as "
    f"'Name (team): action'.\n\n{_MEETING}",
    f"Summarize this passage in three sentences, using its own words.\n\n{_PASSAGE}",
    f"Answer from the passage, quoting it: where does the Rhine begin, where does it end, and what do "
    f"barges carry on it?\n\n{_PASSAGE}",
    f"Repeat these notes as a bulleted list, one bullet per sentence, keeping each sentence as it is.\n\n{_MEETING}",
)

OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip with friends, with one sentence each.",
    "Write a poem about autumn in a big city.",
    "What are the pros and cons of working from home?",
)
