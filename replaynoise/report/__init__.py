"""Report: the tables, figures and summaries a run and a reference are read through, and the cost statement."""
