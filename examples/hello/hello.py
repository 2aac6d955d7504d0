"""The smallest diloco job: each replica says who it is, works a little, and returns."""

import time


def main(ctx, steps: int = 5):
    for step in range(steps):
        ctx.log.info("step %d of %d", step + 1, steps)
        time.sleep(0.1)
    return {"rank": ctx.rank, "world_size": ctx.world_size}
