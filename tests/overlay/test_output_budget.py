"""overlay/output_budget.py: what the commands running at once keep of their output, together."""

from overlay.output_budget import OutputBudget


def test_shares_are_granted_what_is_left_and_give_it_back_and_a_closed_share_gets_nothing():
    budget = OutputBudget(10)
    with budget.share() as first:
        with budget.share() as second:
            assert (first(6), second(6), second(1)) == (6, 4, 0)
            assert budget.used == 10
        assert budget.used == 6 and first(8) == 4
    assert budget.used == 0
    assert first(5) == 0 and budget.used == 0  # a command its exec abandoned keeps nothing more
