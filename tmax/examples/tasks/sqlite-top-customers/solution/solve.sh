#!/bin/bash
{
  echo "customer_name,total_spend"
  sqlite3 -separator ',' /app/shop.db "
    SELECT c.name, printf('%.2f', SUM(o.quantity * p.price_cents) / 100.0)
    FROM orders o
    JOIN customers c ON c.id = o.customer_id
    JOIN products p ON p.id = o.product_id
    WHERE o.status = 'completed' AND o.order_date BETWEEN '2023-01-01' AND '2023-12-31'
    GROUP BY c.id
    ORDER BY SUM(o.quantity * p.price_cents) DESC, c.name ASC
    LIMIT 5;"
} > /app/top_customers.csv
