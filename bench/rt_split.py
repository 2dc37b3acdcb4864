#!/usr/bin/env python3
"""Where a QD1 round trip's time goes, from a `perf script` of bench/rt-split.sh's recording.

Input: `perf script --ns -F tid,time,event,ip,sym,trace` of a recording with the recvfrom,
writev, sendmsg and sendto enter/exit tracepoints and user-space cpu-clock samples at a fixed
period. Two threads exchange the round trips: the two that received the most productive
recvfroms (those that returned bytes). For each of them:

- answer: from a productive recvfrom's return to the next send's entry, when that send comes
  before the next productive recvfrom (the user-space work between receiving a message and
  sending what answers it: parsing, checking, placing, framing);
- send: the send system call's duration (on loopback it includes the receiving side's TCP
  processing, run in the sender's context);
- hand-over: from one thread's send entry to the other's next productive recvfrom's return (the
  send, the other's spinning to notice, its recvfrom);
- the user-space symbols of the samples taken inside answer windows, with the mean time per
  window they stand for (samples x period / windows).

Medians in microseconds. The tracepoints add their own cost to every system call, alike on both
sides of a comparison: compare a case with the floor recorded the same way, not with untraced
figures. The recording slows a round trip several times (every idle recvfrom of a spinning side
is recorded); a side whose busy-poll spell ends meanwhile blocks, and its wake-up lands in the
hand-over: the answer windows are the robust figures, the hand-overs an upper bound.

Usage: rt_split.py PERF_SCRIPT_TEXT PERIOD_NS [TOP]
"""

import statistics
import sys
from collections import Counter, defaultdict

SENDS = {"writev", "sendmsg", "sendto", "write"}


def parse(path):
    per = defaultdict(list)
    with open(path, errors="replace") as f:
        for line in f:
            p = line.split()
            if len(p) < 3:
                continue
            try:
                tid, t = int(p[0]), float(p[1].rstrip(":"))
            except ValueError:
                continue
            ev = p[2].rstrip(":")
            per[tid].append((t, ev, p[3:]))
    return per


def ret_value(s):
    v = int(s, 16) if s.startswith("0x") else int(s)
    return v - (1 << 64) if v >= 1 << 63 else v


def thread_facts(events):
    """Productive receives (time, bytes), sends (entry, duration, bytes), answer windows, and
    the samples inside and outside them."""
    recvs, sends, idle = [], [], 0
    entered = {}
    for t, ev, rest in events:
        if not ev.startswith("syscalls:"):
            continue
        kind, name = ev.split(":")[1].split("_", 2)[1:]
        if kind == "enter":
            entered[name] = t
        elif name == "recvfrom":
            r = ret_value(rest[0])
            if r > 0:
                recvs.append((t, r))
            else:
                idle += 1
        elif name in SENDS and name in entered:
            sends.append((entered[name], t - entered[name], ret_value(rest[0])))
    # Answer windows: a productive receive, then a send before the next productive receive.
    windows = []
    j = 0
    for i, (t, _) in enumerate(recvs):
        while j < len(sends) and sends[j][0] < t:
            j += 1
        nxt = recvs[i + 1][0] if i + 1 < len(recvs) else float("inf")
        if j < len(sends) and sends[j][0] < nxt:
            windows.append((t, sends[j][0]))
    inside, outside = Counter(), Counter()
    w = 0
    for t, ev, rest in events:
        if not ev.startswith("cpu-clock"):
            continue
        while w < len(windows) and windows[w][1] < t:
            w += 1
        sym = " ".join(rest[1:]) or "[unknown]"
        if w < len(windows) and windows[w][0] <= t <= windows[w][1]:
            inside[sym] += 1
        else:
            outside[sym] += 1
    return {
        "recvs": recvs,
        "sends": sends,
        "idle": idle,
        "windows": windows,
        "inside": inside,
        "outside": outside,
    }


def med_us(xs):
    return statistics.median(xs) * 1e6 if xs else float("nan")


def hand_over(a, b):
    """From each send entry of `a` to the next productive receive of `b`."""
    out, j = [], 0
    rb = b["recvs"]
    for t, _, _ in a["sends"]:
        while j < len(rb) and rb[j][0] < t:
            j += 1
        if j < len(rb):
            out.append(rb[j][0] - t)
    return out


def main():
    path, period_ns = sys.argv[1], int(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    per = parse(path)
    facts = {tid: thread_facts(ev) for tid, ev in per.items()}
    busy = sorted(facts, key=lambda t: len(facts[t]["recvs"]), reverse=True)[:2]
    if len(busy) < 2 or not facts[busy[1]]["recvs"]:
        sys.exit("rt_split: fewer than two threads received anything: nothing to split")
    # The first of the pair: the one whose sends are the larger (the 4 KiB side), for a
    # stable order.
    busy.sort(key=lambda t: -statistics.median([s[2] for s in facts[t]["sends"]] or [0]))
    total = 0.0
    for me, other in (busy, busy[::-1]):
        f = facts[me]
        answers = [s - r for r, s in f["windows"]]
        send_durs = [d for _, d, _ in f["sends"]]
        ho = hand_over(f, facts[other])
        total += med_us(answers) + med_us(ho)
        sizes = [n for _, _, n in f["sends"]]
        print(
            f"thread {me}: {len(f['windows'])} answers; sends of {statistics.median(sizes):.0f} B"
            f" (median); answer {med_us(answers):.2f} us, send {med_us(send_durs):.2f} us,"
            f" hand-over to {other} {med_us(ho):.2f} us;"
            f" idle recvfroms per answer {f['idle'] / max(1, len(f['windows'])):.1f}"
        )
        n = sum(f["inside"].values())
        per_window = n * period_ns / 1000 / max(1, len(f["windows"]))
        print(
            f"  user samples in answer windows: {n} (~{per_window:.2f} us per window);"
            f" outside: {sum(f['outside'].values())}"
        )
        for sym, c in f["inside"].most_common(top):
            us = c * period_ns / 1000 / max(1, len(f["windows"]))
            print(f"    {100 * c / max(1, n):5.1f}%  {us:5.2f} us  {sym[:100]}")
    print(f"round trip (answer + hand-over, both ways; medians summed): {total:.2f} us")


if __name__ == "__main__":
    main()
