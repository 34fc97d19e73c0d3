"""Prompts for the speculative-decoding benchmarks. Written for this benchmark.
EDITING asks the model to reproduce, correct or reformat a given passage or piece of code (its
answer repeats much of its prompt, where n-gram proposals pay); CHAT holds plain questions
(where they do not).
"""

import textwrap

EDITING: list[str] = [
    # --- prose -------------------------------------------------------------------------------
    "Repeat the following paragraph exactly:\n\n"
    "The Maple Street Library will be closed on Monday, March 4, while new shelves are "
    "installed in the children's room. Books that are due that day can be returned on Tuesday "
    "without a late fee. The book drop by the front door will stay open, so you may still "
    "return items at any time. Our online catalog and e-book service will work as usual. "
    "Story time for young readers moves to Wednesday at 10 a.m. this week only. If you have "
    "questions, please call the front desk at 555-0142 or ask a staff member during your next "
    "visit.",
    "Fix the spelling mistakes in this text and write it out again:\n\n"
    "1. Preheet the oven to 180 degrees and grease a round cake tin.\n"
    "2. In a large bowl, mix the flour, sugar and a pinch of salt.\n"
    "3. Beat the eggs with the milk and melted butter untill smooth.\n"
    "4. Pour the wet mixure into the dry ingredients and stir gently.\n"
    "5. Fold in the bluberries, taking care not to crush them.\n"
    "6. Spoon the batter into the tin and bake for about fourty minutes.\n"
    "7. Let the cake cool for ten minutes before you take it out of the tin.\n"
    "8. Dust the top with icing sugar and serve it the same day.",
    "Convert this paragraph to British spelling, changing nothing else:\n\n"
    "The Harbor Travel Mug keeps your coffee hot for up to six hours. Its stainless steel body "
    "is available in five colors, including a soft gray and a bright ocean blue. The lid is "
    "designed to seal tightly, so you can toss the mug in your bag without worrying about "
    "leaks. We have optimized the grip to feel comfortable in any hand, and the wide opening "
    "makes it easy to clean. Every mug is packed in a recyclable box and comes with a one-year "
    "warranty. It is the favorite choice of commuters who want their morning drink to stay "
    "warm from the front door to the office.",
    "Correct the grammar in this email and return the full email:\n\n"
    "Hi Sarah,\n\n"
    "Thank you for sending the report yesterday. I have read it and I thinks the numbers looks "
    "good. There is one thing I want to ask about. On page four, the sales for May is lower "
    "than in April, but the chart show the opposite. Could you checks which one are correct? "
    "Me and Tom is meeting the client on Friday, so it would be great to have the final "
    "version by Thursday afternoon. Let me know if you needs any help from our side.\n\n"
    "Best regards,\n"
    "Daniel",
    "Repeat the following meeting summary exactly:\n\n"
    "Meeting summary, 12 June. Present: Anna, Ben, Carla and David. The team reviewed progress "
    "on the new website. Anna reported that the home page design is finished and has been "
    "approved by the client. Ben said the contact form still sends some messages twice and he "
    "expects to fix this by Monday. Carla has written the text for six of the eight product "
    "pages. David raised a concern about the launch date and suggested moving it back by one "
    "week. The team agreed to keep the current date for now and to review it again at the "
    "next meeting, which will be held on 19 June at 2 p.m.",
    'Change every "Tuesday" to "Thursday" in this text and write the whole text out again:\n\n'
    "Welcome to the Oak Hill Community Garden. Volunteers meet every Tuesday at 6 p.m. to "
    "water the beds and pull weeds. Tools are kept in the green shed, and the key hangs on a "
    "hook inside the gate. Please return each tool to its place when you finish. On the first "
    "Tuesday of each month we hold a short meeting to plan new plantings and share the "
    "harvest. Anyone may join, and no experience is needed. If it rains on a Tuesday, the work "
    "session moves to the following day at the same time.",
    "Fix the spelling mistakes in this text and write it out again:\n\n"
    "Last sumer we took the train along the coast to visit my grandparents. The jouney took "
    "almost five hours, but the views were beutiful the whole way. We passed small fishing "
    "villages, long sandy beaches and old stone bridges. My little brother counted every boat "
    "he could see and reached more than two hundred. When we arrived, my grandmother had made "
    "a big pot of vegetable soup and fresh bread. We spent the evening in the garden, talking "
    "and watching the sun go down over the water. It was one of the best days of the hole "
    "holiday.",
    "Rewrite this paragraph with each sentence on its own line, changing no words:\n\n"
    "Items bought in our store can be returned within 30 days. Please bring the receipt and "
    "the original packaging. Clothes must be unworn and still have their tags attached. "
    "Electronics can be returned only if the seal on the box has not been broken. Sale items "
    "can be exchanged but not refunded. Gift cards cannot be returned or exchanged for cash. "
    "Refunds are paid back to the card used for the purchase and usually appear within five "
    "working days. If an item arrives damaged, contact us within 48 hours and we will send a "
    "free replacement.",
    # --- code --------------------------------------------------------------------------------
    "Add type hints to these Python functions and return the whole code:\n\n"
    + textwrap.dedent(
        """\
        def average_score(scores, default):
            if not scores:
                return default
            total = 0
            for score in scores:
                total += score
            return total / len(scores)


        def top_names(records, limit):
            ranked = sorted(records, key=lambda r: r["score"], reverse=True)
            names = []
            for record in ranked[:limit]:
                names.append(record["name"])
            return names
        """
    ),
    "Rename the variable `x` to `count` in this code and return all of it:\n\n"
    + textwrap.dedent(
        """\
        def count_words(path):
            x = 0
            with open(path, encoding="utf-8") as f:
                for line in f:
                    words = line.split()
                    x += len(words)
            return x


        def main():
            x = count_words("notes.txt")
            if x == 0:
                print("The file is empty.")
            else:
                print(f"The file has {x} words.")


        if __name__ == "__main__":
            main()
        """
    ),
    "Add a one-line docstring to each method of this Python class and return the whole class:\n\n"
    + textwrap.dedent(
        """\
        class ShoppingCart:
            def __init__(self):
                self.items = {}

            def add(self, name, price, quantity=1):
                if name in self.items:
                    old_price, old_quantity = self.items[name]
                    self.items[name] = (old_price, old_quantity + quantity)
                else:
                    self.items[name] = (price, quantity)

            def remove(self, name):
                self.items.pop(name, None)

            def total(self):
                return sum(price * quantity for price, quantity in self.items.values())
        """
    ),
    "Replace every `var` with `const` or `let` in this JavaScript code and return all of it:\n\n"
    + textwrap.dedent(
        """\
        var TAX_RATE = 0.2;

        function totalWithTax(items) {
          var total = 0;
          for (var i = 0; i < items.length; i++) {
            var item = items[i];
            total += item.price * item.quantity;
          }
          return total * (1 + TAX_RATE);
        }

        function formatPrice(amount) {
          var rounded = Math.round(amount * 100) / 100;
          return "$" + rounded.toFixed(2);
        }

        var cart = [
          { name: "pen", price: 1.5, quantity: 4 },
          { name: "notebook", price: 3.25, quantity: 2 },
        ];
        console.log(formatPrice(totalWithTax(cart)));
        """
    ),
    "Rewrite this SQL query with all keywords in uppercase and return the full query:\n\n"
    + textwrap.dedent(
        """\
        select c.id,
               c.name,
               count(o.id) as order_count,
               sum(o.total) as total_spent
        from customers c
        left join orders o on o.customer_id = c.id
        where c.created_at >= '2023-01-01'
          and c.country = 'Canada'
        group by c.id, c.name
        having count(o.id) > 2
        order by total_spent desc
        limit 20;
        """
    ),
    "Fix the bug in this Python function and return the whole code:\n\n"
    + textwrap.dedent(
        """\
        def find_longest_word(sentence):
            words = sentence.split()
            if not words:
                return ""
            longest = words[0]
            for i in range(1, len(words) - 1):
                if len(words[i]) > len(longest):
                    longest = words[i]
            return longest


        print(find_longest_word("the quick brown fox jumps over the lazy elephant"))
        """
    ),
    "Rename the function `getData` to `fetchUser` in this code and return all of it:\n\n"
    + textwrap.dedent(
        """\
        async function getData(userId) {
          const response = await fetch(`/api/users/${userId}`);
          if (!response.ok) {
            throw new Error("Request failed with status " + response.status);
          }
          return response.json();
        }

        async function showUser(userId) {
          try {
            const user = await getData(userId);
            document.getElementById("name").textContent = user.name;
            document.getElementById("email").textContent = user.email;
          } catch (err) {
            console.error("Could not load user:", err);
          }
        }

        showUser(42);
        """
    ),
    "Reformat this Python code to use four spaces for indentation instead of two, "
    "and return all of it:\n\n"
    + textwrap.dedent(
        """\
        import csv


        def load_prices(path):
          prices = {}
          with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
              prices[row["item"]] = float(row["price"])
          return prices


        def cheapest(prices):
          if not prices:
            return None
          return min(prices, key=prices.get)


        if __name__ == "__main__":
          data = load_prices("prices.csv")
          print("Cheapest item:", cheapest(data))
        """
    ),
    # --- structured data ---------------------------------------------------------------------
    "Reformat this JSON with two-space indentation:\n\n"
    '{"name": "Green Valley Hotel", "city": "Lyon", "rooms": 48, "open": true, '
    '"rating": 4.3, "amenities": ["wifi", "parking", "breakfast", "gym"], '
    '"contact": {"phone": "+33 4 00 00 00 00", "email": "info@greenvalley.example"}, '
    '"checkin": "15:00", "checkout": "11:00", "languages": ["French", "English", "Spanish"]}',
    "Rewrite this list as a Markdown table with the columns Item, Amount, Price and Shop:\n\n"
    "- Apples: 3 kg, $4.50, Farm Stand\n"
    "- Bread: 2 loaves, $6.00, Corner Bakery\n"
    "- Milk: 4 liters, $5.20, Green Grocer\n"
    "- Cheese: 500 g, $7.80, Green Grocer\n"
    "- Eggs: 12, $3.90, Farm Stand\n"
    "- Coffee: 1 bag, $9.99, Bean House\n"
    "- Rice: 2 kg, $4.10, Green Grocer\n"
    "- Tomatoes: 1 kg, $2.75, Farm Stand",
    "Convert this CSV to a Markdown table, keeping every row:\n\n"
    "name,department,start_date,office\n"
    "Alice Moreno,Engineering,2019-04-15,Berlin\n"
    "Brian Cho,Sales,2020-09-01,Toronto\n"
    "Chloe Adams,Marketing,2018-01-22,London\n"
    "Diego Ruiz,Engineering,2021-06-30,Madrid\n"
    "Emma Novak,Finance,2017-11-08,Prague\n"
    "Farid Haddad,Support,2022-02-14,Toronto\n"
    "Grace Kim,Engineering,2020-03-03,Seoul\n"
    "Henry Walsh,Sales,2016-07-19,Dublin",
    "Sort these lines alphabetically and write out the full list:\n\n"
    "Norway: Oslo\n"
    "Kenya: Nairobi\n"
    "Brazil: Brasilia\n"
    "Japan: Tokyo\n"
    "Egypt: Cairo\n"
    "Canada: Ottawa\n"
    "Peru: Lima\n"
    "Australia: Canberra\n"
    "Greece: Athens\n"
    "Mexico: Mexico City\n"
    "India: New Delhi\n"
    "Finland: Helsinki",
]

CHAT: list[str] = [
    "What causes the seasons on Earth?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "How do plants make their own food?",
    "What is a good way to start learning to cook?",
    "Can you explain what a computer program is?",
    "What are some fun things to do on a rainy day?",
    "How does a rainbow form?",
    "Why do cats purr?",
    "What should I pack for a weekend camping trip?",
    "How can I save money on groceries?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Why do we need to drink water every day?",
    "How do airplanes stay in the air?",
    "What are the benefits of reading books?",
    "Tell me a short story about a friendly dragon.",
    "How can I become a better public speaker?",
    "What is the tallest mountain in the world?",
    "Give me some ideas for a healthy breakfast.",
]
