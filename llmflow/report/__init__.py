"""Reports: formula-safe CSV/XLSX tables (tables.py) and the self-contained HTML report (html.py)."""
