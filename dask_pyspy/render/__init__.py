"""The HTML pages (reports, the diff page, the dashboard's page) and their charts, drawn
from what they are given: no import of the profile model or of the servers."""
