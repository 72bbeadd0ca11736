"""Keeps every CPU core busy (one spinning process per core) for a while."""
import multiprocessing as mp
import time


def spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


if __name__ == "__main__":
    procs = [mp.Process(target=spin, args=(120,)) for _ in range(mp.cpu_count())]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
