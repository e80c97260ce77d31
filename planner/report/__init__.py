"""Plans as a reviewer reads them: plan files and their drift check, renderings, comparisons
and plots."""
