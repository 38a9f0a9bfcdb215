"""The report: tables and figures of the summary notebook, and its rendering to self-contained HTML."""
