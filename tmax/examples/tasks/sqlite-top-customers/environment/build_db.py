"""Builds /app/shop.db deterministically (fixed seed). Run once at image build time."""
import random
import sqlite3
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "/app/shop.db"
r = random.Random(1337)
first = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Femi", "Greta", "Hiro", "Ines", "Jonas",
         "Kira", "Luca", "Maya", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
last = ["Alvarez", "Becker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen",
        "Ivanova", "Jensen", "Kowalski", "Larsen", "Moreau", "Novak", "Okafor"]
countries = ["DE", "FR", "ES", "IT", "NL", "PL", "SE"]
cats = ["books", "garden", "kitchen", "toys", "tools"]

con = sqlite3.connect(path)
con.executescript("""
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL,
                        email TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL,
                       price_cents INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     product_id INTEGER NOT NULL REFERENCES products(id),
                     quantity INTEGER NOT NULL, order_date TEXT NOT NULL, status TEXT NOT NULL);
""")
names = set()
cid = 0
while cid < 40:
    n = f"{r.choice(first)} {r.choice(last)}"
    if n in names:
        continue
    names.add(n)
    cid += 1
    con.execute("INSERT INTO customers VALUES (?,?,?,?)",
                (cid, n, r.choice(countries), n.lower().replace(" ", ".") + "@example.org"))
for pid in range(1, 26):
    con.execute("INSERT INTO products VALUES (?,?,?,?)",
                (pid, f"{r.choice(cats).title()} item {pid:02d}", r.choice(cats),
                 r.randint(199, 24999)))
statuses = ["completed"] * 15 + ["cancelled"] * 3 + ["refunded"] * 2
for oid in range(1, 613):
    year = r.choice([2022, 2023, 2023, 2024])
    month, day = r.randint(1, 12), r.randint(1, 28)
    # a few heavy buyers so the ranking is not flat
    cust = r.randint(1, 40) if r.random() < 0.8 else r.choice([3, 7, 11, 19, 23, 31])
    con.execute("INSERT INTO orders VALUES (?,?,?,?,?,?)",
                (oid, cust, r.randint(1, 25), r.randint(1, 6),
                 f"{year}-{month:02d}-{day:02d}", r.choice(statuses)))
con.commit()
con.close()
