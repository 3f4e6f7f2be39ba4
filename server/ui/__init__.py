"""The page served at /ui (server/api/ui.py): index.html, style.css and JavaScript modules, with no build step."""
