"""Writes ``bench_traces/bfcl_multi_turn_sample.jsonl``: a seeded sample in the BFCL v3/v4
multi-turn question format (``id``, ``question``: user turns of messages, ``involved_classes``,
``ground_truth``: the call strings of each user turn), for the ``agents`` bench suite.

Nothing is downloaded: the entries are composed here from task templates over BFCL's API
classes, so the suite has an imported public-format trace without shipping BFCL's data.
``workloads.importers.import_bfcl`` reads it like a file of the real benchmark.

    python scripts/make_bfcl_sample.py [--entries 400] [--seed 2026] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: Per API class: (user request template, the calls that serve it).
TASKS: dict[str, list[tuple[str, list[str]]]] = {
    "GorillaFileSystem": [
        ("Go into the '{d}' folder and list everything there, hidden files too.", ["cd(folder='{d}')", "ls(a=True)"]),
        ("Make a directory named '{d}_backup' and copy '{f}' into it.",
         ["mkdir(dir_name='{d}_backup')", "cp(source='{f}', destination='{d}_backup')"]),
        ("How many lines does '{f}' have? Then show me the last {n} of them.",
         ["wc(file_name='{f}', mode='l')", "tail(file_name='{f}', lines={n})"]),
        ("Search '{f}' for the word '{w}' and sort what you find.", ["grep(file_name='{f}', pattern='{w}')", "sort(file_name='{f}')"]),
        ("Find every file under the current folder whose name mentions '{w}'.", ["find(path='.', name='{w}')"]),
        ("Rename '{f}' to 'final_{f}' and tell me how big it is.", ["mv(source='{f}', destination='final_{f}')", "du(human_readable=True)"]),
    ],
    "TwitterAPI": [
        ("Post a tweet saying that the {w} report is done, tagged #{w} and mention @{u}.",
         ["authenticate_twitter(username='{u}', password='pw{n}')", "post_tweet(content='The {w} report is done', tags=['#{w}'], mentions=['@{u}'])"]),
        ("Comment 'great work on {w}' under my latest tweet.", ["get_user_tweets(username='{u}')", "comment(tweet_id={n}, comment_content='great work on {w}')"]),
        ("Retweet tweet {n} and follow its author.", ["retweet(tweet_id={n})", "follow_user(username_to_follow='{u}')"]),
    ],
    "MessageAPI": [
        ("Send '{w} meeting moved to {n} pm' to user {u}.", ["message_login(user_id='{u}')", "send_message(receiver_id='{u}', message='{w} meeting moved to {n} pm')"]),
        ("Show me the messages I have received, then delete the one from {u}.", ["view_messages_sent()", "delete_message(receiver_id='{u}')"]),
    ],
    "MathAPI": [
        ("What is the mean of {n}, {m} and {k}? Round it to two decimals.", ["mean(numbers=[{n}, {m}, {k}])", "round_number(number={n}.5, decimal_places=2)"]),
        ("Compute the standard deviation of the numbers in '{f}'.", ["standard_deviation(numbers=[{n}, {m}, {k}])"]),
        ("Convert {n} kilometres to miles and take the square root.", ["si_unit_conversion(value={n}, unit_in='km', unit_out='mi')", "square_root(number={n})"]),
    ],
    "TicketAPI": [
        ("Open a ticket titled '{w} outage' with priority {k} describing that {f} is missing.",
         ["create_ticket(title='{w} outage', description='{f} is missing', priority={k})"]),
        ("Close ticket {n} and tell me its final status.", ["get_ticket(ticket_id={n})", "close_ticket(ticket_id={n})"]),
    ],
    "TradingBot": [
        ("Buy {n} shares of {s} at market price and show my account balance.",
         ["get_stock_info(symbol='{s}')", "place_order(order_type='Buy', symbol='{s}', price={m}.0, amount={n})", "get_account_info()"]),
        ("Add {s} to my watchlist and cancel order {k}.", ["add_to_watchlist(stock='{s}')", "cancel_order(order_id={k})"]),
    ],
    "TravelAPI": [
        ("Book the cheapest flight from {c} to {c2} on 2026-0{k}-1{k} in economy.",
         ["get_flight_cost(travel_from='{c}', travel_to='{c2}', travel_date='2026-0{k}-1{k}', travel_class='economy')",
          "book_flight(access_token='tok', card_id='card{n}', travel_date='2026-0{k}-1{k}', travel_from='{c}', travel_to='{c2}', travel_class='economy')"]),
        ("Buy travel insurance for booking {n} and retrieve the invoice.",
         ["purchase_insurance(access_token='tok', insurance_type='comprehensive', booking_id='{n}', insurance_cost={m}.0, card_id='card{k}')",
          "retrieve_invoice(access_token='tok', booking_id='{n}')"]),
    ],
    "VehicleControlAPI": [
        ("Start the engine, lock all doors and set the cabin to {k}0 degrees.",
         ["lockDoors(unlock=False, door=['driver', 'passenger', 'rear_left', 'rear_right'])", "startEngine(ignitionMode='START')",
          "adjustClimateControl(temperature={k}0, unit='fahrenheit')"]),
        ("How far can I go on the fuel left? Fill up {n} gallons first.", ["fillFuelTank(fuelAmount={n})", "estimate_distance(cityA='{c}', cityB='{c2}')"]),
    ],
}

WORDS = ("budget", "quarterly", "launch", "roadmap", "audit", "migration", "release", "security", "hiring", "design")
FILES = ("notes.txt", "report.csv", "draft.md", "log.txt", "summary.pdf", "data.json", "todo.txt")
DIRS = ("documents", "projects", "archive", "workspace", "temp", "research")
USERS = ("alice", "bob", "carol", "dave", "erin", "frank")
SYMBOLS = ("NVDA", "AAPL", "MSFT", "AMZN", "GOOG", "TSLA")
CITIES = ("SFO", "JFK", "LAX", "ORD", "SEA", "BOS", "ATL")


def entry(index: int, rng: random.Random) -> dict[str, object]:
    """One BFCL-format multi-turn entry: 1-2 API classes, 2-6 user turns."""
    classes = rng.sample(sorted(TASKS), k=rng.choice((1, 1, 2)))
    questions: list[list[dict[str, str]]] = []
    truth: list[list[str]] = []
    for _ in range(rng.randint(2, 6)):
        cls = rng.choice(classes)
        template, calls = rng.choice(TASKS[cls])
        fill = {
            "d": rng.choice(DIRS), "f": rng.choice(FILES), "w": rng.choice(WORDS), "u": rng.choice(USERS),
            "s": rng.choice(SYMBOLS), "c": rng.choice(CITIES), "c2": rng.choice(CITIES),
            "n": rng.randint(2, 90), "m": rng.randint(10, 400), "k": rng.randint(1, 9),
        }
        questions.append([{"role": "user", "content": template.format(**fill)}])
        truth.append([c.format(**fill) for c in calls])
    return {
        "id": f"multi_turn_sample_{index}",
        "question": questions,
        "involved_classes": classes,
        "ground_truth": truth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=400)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=Path("bench_traces/bfcl_multi_turn_sample.jsonl"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with args.out.open("w") as f:
        for i in range(args.entries):
            f.write(json.dumps(entry(i, rng)) + "\n")
    print(f"{args.entries} entries -> {args.out}")


if __name__ == "__main__":
    main()
