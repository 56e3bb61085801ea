"""The prompt budget beside decodes, steered from step times (kvferry.prompt_budget).

Logic only: step times come from a cost model, as a CPU and a GPU showed them."""

from kvferry.prompt_budget import BAND, CEILING, CPU_FLOOR, FIXED, FLOOR, TARGET, PromptBudget

DECODE = 0.012  # s, a plain decode step


def steer(cost, steps: int = 60, rows: int = 4, floor: int = FLOOR) -> tuple[PromptBudget, list[float]]:
    """Alternate decode-only and decode+prompt steps; the prompt part takes the budget."""
    b = PromptBudget(floor=floor)
    ratios = []
    for _ in range(steps):
        b.observe(rows, 0, DECODE)
        n = b.tokens
        dt = cost(n)
        b.observe(rows, n, dt)
        ratios.append(dt / DECODE)
    return b, ratios


def test_where_tokens_cost_the_budget_holds_a_step_near_its_target():
    b, ratios = steer(lambda n: DECODE * (1 + n / 16))  # a CPU: 16 prompt tokens cost a decode step
    assert b.target == TARGET < 2 - 3 * BAND  # room under the 2x p99 target for a noisy machine
    assert 4 <= b.tokens <= 12
    assert max(ratios[-20:]) <= TARGET + BAND + 1e-9


def test_where_a_prompt_pass_costs_the_same_at_any_size_the_chunk_grows():
    # an H200: any chunk up to ~256 tokens costs ~one decode step (launch-bound), then tokens count
    b, ratios = steer(lambda n: DECODE * (1.95 + max(0, n - 256) / 256))
    assert b.target > 2.0  # the floor (1.95x) plus headroom: TARGET cannot be had
    assert b.tokens >= 128  # not stuck at FLOOR, where a 2k prompt went in 4 tokens a step
    assert max(ratios[-20:]) <= b.target + 0.1 + 1e-9
    assert FLOOR <= b.tokens <= CEILING


def long_context(n: int) -> float:
    """A CPU late in a 2k prompt (SmolLM2 beside 4 decode rows of 79 ms): 1.39x at one
    token, 1.86x at four; each token costs, none of it is fixed."""
    return DECODE * (1.23 + 0.157 * n)


def test_where_each_token_costs_a_cpu_goes_down_to_one_token_a_step():
    b, ratios = steer(long_context, floor=CPU_FLOOR)
    assert b.tokens == CPU_FLOOR == 1 and b.target == TARGET
    assert max(ratios[-20:]) < 1.5  # not the ~2x of a 4-token floor read as a fixed cost (below)


def test_a_four_token_floor_there_read_the_per_token_cost_as_fixed():
    # the GPU floor on that CPU: what a 2,280-token prompt did to the decoders' p99 (docs/performance-log.md)
    b, ratios = steer(long_context, floor=FLOOR)
    assert b.target > FIXED and max(ratios[-20:]) > 1.8


def test_a_prompt_only_step_or_no_decode_step_yet_changes_nothing():
    b = PromptBudget(tokens=16)
    b.observe(0, 512, 1.0)  # nobody decoding
    b.observe(4, 16, 1.0)  # no plain decode step measured yet
    assert b.tokens == 16 and b.target == TARGET
